"""What every run shares, pretraining and RL alike: its directory, manifest, metrics sinks,
checkpoint policy and the per-step scalar reduction (``lockstep.run.step``).

A workload (``lockstep.train.trainer.Trainer``, ``lockstep.rl.trainer.RLTrainer``) owns its loop
and adds its own manifest sections, rank state and resumable config fields; the rest lives here once.
"""

from lockstep.run.checkpoint import CheckpointPolicy, RankState, config_changes
from lockstep.run.config import DEVICES, SinkOutputs, validate_device
from lockstep.run.directory import (
    agree_on_run_dir,
    check_run_dir,
    default_run_dir,
    has_checkpoint,
    save_weights,
    seed_everything,
    truncate_metrics,
)
from lockstep.run.nonfinite import NONFINITE_POLICIES, NonFiniteError, NonFiniteGuard
from lockstep.run.manifest import COMMON_SECTIONS, run_manifest
from lockstep.run.sinks import MetricsSink, RunLog, TensorBoardSink, WandbSink, scalars
from lockstep.run.step import StepLoss, StepScalars

__all__ = [
    "COMMON_SECTIONS",
    "CheckpointPolicy",
    "DEVICES",
    "MetricsSink",
    "NONFINITE_POLICIES",
    "NonFiniteError",
    "NonFiniteGuard",
    "RankState",
    "RunLog",
    "SinkOutputs",
    "StepLoss",
    "StepScalars",
    "TensorBoardSink",
    "WandbSink",
    "agree_on_run_dir",
    "check_run_dir",
    "config_changes",
    "default_run_dir",
    "has_checkpoint",
    "run_manifest",
    "save_weights",
    "scalars",
    "seed_everything",
    "truncate_metrics",
    "validate_device",
]
