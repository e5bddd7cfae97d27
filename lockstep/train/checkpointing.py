"""The trainer's checkpoint policy: resume from the latest checkpoint, save every N steps and at
the end, report each save's timings as its own metrics record (never inside step time)."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.checkpoint import CheckpointConfig, Checkpointer, latest_step, storage_from_uri
from lockstep.checkpoint.reader import read_index
from lockstep.checkpoint.train_state import (
    ensure_optimizer_state, model_slots, optimizer_groups, optimizer_slots, rng_state, set_rng_state,
)
from lockstep.config.base import ConfigError, to_dict

#: config fields a resumed run may change without changing what is trained
RESUMABLE_CHANGES = ("steps", "stop_after", "run_dir", "resume", "checkpoint", "output", "parallel", "recipe",
                     "validation")


def has_checkpoint(config: CheckpointConfig, run_dir: Path) -> int | None:
    return latest_step(storage_from_uri(config.location(run_dir), endpoint_url=config.endpoint_url))


def check_run_dir(config: CheckpointConfig, run_dir: Path, resume: bool) -> None:
    """A resumed run needs a complete checkpoint; a new one needs a directory without a run in it."""
    if resume:
        if has_checkpoint(config, run_dir) is None:
            raise ConfigError(f"resume: no complete checkpoint in {config.location(run_dir)} to continue from")
    elif (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run_dir: {run_dir} already holds a run (metrics.jsonl); choose another, or --resume it")


def config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted paths whose values differ between two config dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


class TrainCheckpointing:
    """Owns the run's Checkpointer on this rank; the Trainer calls ``resume``, ``after_step``, ``close``."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        cfg = trainer.config
        self.every = cfg.checkpoint.every
        self.checkpointer: Checkpointer = cfg.checkpoint.build(trainer.run_dir, rank=trainer.runtime.rank,
                                                               world_size=trainer.runtime.world_size)
        self._slot_cache: dict | None = None
        if self.every:
            self.checkpointer.prepare(self._slots())

    def _slots(self) -> dict:
        """Every saved tensor of this rank. Built once: parameters and optimizer state are updated
        in place for the whole run, so the same views stay valid (and rebuilding costs ~20 ms)."""
        if self._slot_cache is None:
            t = self.trainer
            ensure_optimizer_state(t.optimizer)
            self._slot_cache = {**model_slots(t.model), **optimizer_slots(t.model, t.optimizer)}
        return self._slot_cache

    def resume(self) -> dict:
        """Load the latest checkpoint into model, optimizer, loader and RNG; returns what the manifest records."""
        t = self.trainer
        storage = self.checkpointer.storage
        step = self.checkpointer.latest_step()
        saved_config = read_index(storage, step).get("metadata", {}).get("config", {})
        changes = [c for c in config_changes(saved_config, to_dict(t.config))
                   if c.split(".")[0] not in RESUMABLE_CHANGES]
        if changes:  # before touching tensors: a changed model would only list mismatched shapes
            raise ConfigError(f"resume: the checkpoint at step {step} in {storage.describe()} was trained with a "
                              f"different config: {', '.join(changes)} changed (only "
                              f"{', '.join(RESUMABLE_CHANGES)} may change)")
        step, state, meta = self.checkpointer.load(self._slots(), step)
        try:
            t.data.train.load_state_dict(state["data"])
        except ValueError as err:
            raise ConfigError(f"resume: {err}") from None
        set_rng_state(state["rng"])
        return {"from_step": step, "storage": self.checkpointer.storage.describe(),
                "saved_world_size": meta.get("world_size"), "world_size": t.runtime.world_size}

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == last)

    def save(self, step: int) -> None:
        t = self.trainer
        rank_state = {"data": t.data.train.state_dict(), "rng": rng_state(),
                      "optimizer_groups": optimizer_groups(t.model, t.optimizer)}
        meta = {"family": t.config.model.family, "flavor": t.config.model.flavor, "step": step,
                "world_size": t.runtime.world_size, "config": json.loads(json.dumps(to_dict(t.config)))}
        self.checkpointer.save(step, self._slots(), rank_state, meta)

    def records(self, wait: bool = False) -> list[dict]:
        done = self.checkpointer.wait() if wait else self.checkpointer.poll()
        return [s.record() for s in done]

    def close(self, abandon: bool = False) -> list[dict]:
        return [s.record() for s in self.checkpointer.close(abandon=abandon)]
