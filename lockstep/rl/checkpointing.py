"""RL checkpoints: policy, optimizer, frozen reference (when KL is on), RNG, policy version.

Saved with the same :class:`~lockstep.checkpoint.Checkpointer` as pretraining (staged, written by a
background process, atomic). The task position needs no state of its own: step ``i`` trains on
task seeds derived from ``i`` and every request's sampling seed from (task seed, sample, turn), so
the policy version (= the step) is the sampler's state. A resumed run continues at step k + 1 with
the same weights, optimizer moments and RNG; the generators receive version k from the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.checkpoint import Checkpointer
from lockstep.checkpoint.reader import read_index
from lockstep.checkpoint.train_state import (
    ensure_optimizer_state, model_slots, optimizer_groups, optimizer_slots, rng_state, set_rng_state,
)
from lockstep.config.base import ConfigError, to_dict
from lockstep.rl.config import RLConfig
from lockstep.rl.learner import Learner
from lockstep.train.checkpointing import config_changes

#: config sections a resumed RL run may change without changing what is trained
RESUMABLE_CHANGES = ("steps", "stop_after", "run_dir", "resume", "checkpoint", "output", "recipe", "workers",
                     "parallel")

__all__ = ["RLCheckpointing", "RESUMABLE_CHANGES"]


class RLCheckpointing:
    """The trainer's checkpoint policy for an RL run; every trainer rank has one (its shard)."""

    def __init__(self, config: RLConfig, run_dir: Path, learner: Learner, *, rank: int = 0, world_size: int = 1,
                 group=None) -> None:
        self.config, self.learner = config, learner
        self.every = config.checkpoint.every
        self.world_size = world_size
        self.checkpointer: Checkpointer = config.checkpoint.build(run_dir, rank=rank, world_size=world_size,
                                                                  group=group)
        ensure_optimizer_state(learner.optimizer)
        self.slots = {**model_slots(learner.model), **optimizer_slots(learner.model, learner.optimizer)}
        if learner.reference is not None:
            self.slots.update({"reference/" + k.removeprefix("model/"): v
                               for k, v in model_slots(learner.reference).items()})
        if self.every:
            self.checkpointer.prepare(self.slots)

    def resume(self) -> dict:
        """Load the latest checkpoint; returns what the manifest records (``from_step`` included)."""
        storage = self.checkpointer.storage
        step = self.checkpointer.latest_step()
        saved = read_index(storage, step).get("metadata", {}).get("config", {})
        changes = [c for c in config_changes(saved, to_dict(self.config)) if c.split(".")[0] not in RESUMABLE_CHANGES]
        if changes:
            raise ConfigError(f"resume: the checkpoint at step {step} in {storage.describe()} was made with a "
                              f"different config: {', '.join(changes)} changed (only "
                              f"{', '.join(RESUMABLE_CHANGES)} may change)")
        step, state, _ = self.checkpointer.load(self.slots, step)
        set_rng_state(state["rng"])
        return {"from_step": step, "policy_version": state["policy_version"], "storage": storage.describe()}

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == last)

    def save(self, step: int) -> None:
        learner = self.learner
        rank_state = {"rng": rng_state(), "policy_version": step,
                      "optimizer_groups": optimizer_groups(learner.model, learner.optimizer)}
        meta = {"family": self.config.model.family, "flavor": self.config.model.flavor, "step": step,
                "world_size": self.world_size, "kind": "rl", "config": json.loads(json.dumps(to_dict(self.config)))}
        self.checkpointer.save(step, self.slots, rank_state, meta)

    def records(self, wait: bool = False) -> list[dict]:
        done = self.checkpointer.wait() if wait else self.checkpointer.poll()
        return [s.record() for s in done]

    def close(self) -> list[dict]:
        return [s.record() for s in self.checkpointer.close()]
