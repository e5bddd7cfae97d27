"""RL's use of the shared checkpoint policy (:class:`lockstep.run.CheckpointPolicy`): policy,
optimizer, frozen reference (``reference/``, when KL is on), RNG, policy version.

The same layout on disk as pretraining's, written by the same Checkpointer. The task position needs
no state of its own: step ``i`` trains on task seeds derived from ``i`` and every request's sampling
seed from (task seed, sample, turn), so the policy version (= the step) is the sampler's state. A
resumed run continues at step k + 1 with the same weights, optimizer moments and RNG; the generators
receive version k from the trainer.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.rl.config import RLConfig
from lockstep.rl.learner import Learner
from lockstep.run import CheckpointPolicy, RankState

#: config sections a resumed RL run may change without changing what is trained
RESUMABLE_CHANGES = ("steps", "stop_after", "run_dir", "resume", "checkpoint", "output", "recipe", "workers",
                     "liveness", "parallel", "training.device", "training.on_nonfinite", "training.max_rollbacks",
                     # how the step executes, not what it computes (graph = eager bitwise; recompute
                     # reproduces the saved activations; compiled kernels are the same math)
                     "training.mode", "training.activation_checkpoint", "training.threads", "graph", "compile",
                     "allow_unverified_weights")

__all__ = ["RESUMABLE_CHANGES", "build_checkpointing"]


def build_checkpointing(config: RLConfig, run_dir: Path, learner: Learner, *, rank: int = 0, world_size: int = 1,
                        group=None) -> CheckpointPolicy:
    """The trainer rank's checkpoint policy for an RL run (every trainer rank has one: its shard)."""
    extra = {"reference": learner.reference} if learner.reference is not None else {}
    return CheckpointPolicy(config, run_dir, model=learner.model, optimizer=learner.optimizer, kind="rl",
                            resumable=RESUMABLE_CHANGES, extra_modules=extra,
                            rank_state=RankState(save=lambda step: {"policy_version": step},
                                                 load=lambda state: {"policy_version": state["policy_version"]}),
                            rank=rank, world_size=world_size, group=group)
