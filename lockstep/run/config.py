"""Config pieces both run kinds share: the ``device`` choice and the metrics-sink switches.

``TrainingConfig`` and ``RLTrainingConfig`` carry ``device`` (checked by :func:`validate_device`);
``OutputConfig`` and ``RLOutputConfig`` derive from :class:`SinkOutputs`, so ``--output.tensorboard``
and ``--output.wandb`` mean the same in ``lockstep train`` and ``lockstep rl``.
"""

from __future__ import annotations

import dataclasses
import importlib
import types


from lockstep.config.base import Config, ConfigError, require_choice

#: where the model, batches and autocast live: "auto" = CUDA when available, else the CPU
DEVICES = ["auto", "cpu", "cuda"]


def validate_device(value: str, path: str) -> None:
    """``value`` is one of :data:`DEVICES`, and CUDA is there when it is asked for by name."""
    require_choice(value, DEVICES, path)
    if value == "cuda":
        from lockstep.parallel.launch import resolve_device

        resolve_device(value, path)  # its ConfigError when torch sees no GPU


def import_wandb(path: str = "output.wandb") -> types.ModuleType:
    """The ``wandb`` module, or a ConfigError naming ``path`` when it is not installed (it is optional)."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ConfigError(f"{path}: Weights & Biases logging was asked for, but the wandb package is not "
                          f"installed; `pip install wandb` (it stays optional), or leave {path} off") from None


@dataclasses.dataclass(kw_only=True)
class SinkOutputs(Config):
    """Where the main rank's metrics go besides ``metrics.jsonl`` (every numeric scalar of every record)."""

    #: also write TensorBoard event files (run_dir/tensorboard; `tensorboard --logdir RUN_DIR`)
    tensorboard: bool = True
    #: also log to Weights & Biases, offline (run_dir/wandb; `wandb sync` uploads it); needs `pip install wandb`
    wandb: bool = False
    #: the W&B project name of that offline run
    wandb_project: str = "lockstep"

    def validate(self, path: str = "output") -> None:
        super().validate(path)
        if self.wandb:
            import_wandb(f"{path}.wandb")
