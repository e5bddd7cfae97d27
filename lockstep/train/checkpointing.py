"""Pretraining's use of the shared checkpoint policy (:class:`lockstep.run.CheckpointPolicy`): which
config changes a resume accepts, and the per-rank state it adds (the data loader's position)."""

from __future__ import annotations

from lockstep.config.base import ConfigError
from lockstep.run import CheckpointPolicy, RankState

#: config fields a resumed run may change without changing what is trained
RESUMABLE_CHANGES = ("steps", "stop_after", "run_dir", "resume", "checkpoint", "output", "parallel", "recipe",
                     "validation", "training.device", "training.on_nonfinite", "training.max_rollbacks",
                     # how the step executes, not what it computes (graph = eager bitwise; recompute
                     # reproduces the saved activations; compiled kernels are the same math)
                     "training.mode", "training.activation_checkpoint", "training.threads", "graph", "compile",
                     "allow_unverified_weights",
                     # the GEMMs' precision (FP8/MXFP8): weights and optimizer state are full precision
                     # either way, so a converted run continues unconverted and back (docs/numerics.md);
                     # transforms are a record only, their effects are the fields compared above
                     "low_precision", "transforms")


def build_checkpointing(trainer) -> CheckpointPolicy:
    """The Trainer's checkpoint policy on this rank (model, optimizer, RNG, loader position)."""

    def load(state: dict) -> dict:
        try:
            trainer.data.train.load_state_dict(state["data"])
        except ValueError as err:
            raise ConfigError(f"resume: {err}") from None
        return {}

    runtime = trainer.runtime
    return CheckpointPolicy(trainer.config, trainer.run_dir, model=trainer.model, optimizer=trainer.optimizer,
                            kind="train", resumable=RESUMABLE_CHANGES,
                            rank_state=RankState(save=lambda step: {"data": trainer.data.train.state_dict()},
                                                 load=load),
                            rank=runtime.rank, world_size=runtime.world_size, group=runtime.group)
