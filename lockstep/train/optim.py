"""Optimizer and learning-rate schedule configs (AdamW or Muon; warmup+cosine, warmup-stable-decay)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version

from lockstep.config.base import Config, require, require_choice, require_positive


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig(Config):
    """The optimizer: ``name="adamw"`` (AdamW; weight decay on matrices only, not norms, biases or 1-D
    parameters) or ``name="muon"`` (Muon on 2-D hidden matrices, this AdamW on the rest; see
    :mod:`lockstep.train.muon`). ``lr``, ``weight_decay`` and the Adam fields mean the same in both:
    Muon's update is scaled to AdamW's update RMS, so they carry over."""

    #: "adamw", or "muon" (Newton-Schulz-orthogonalised momentum on hidden matrices, AdamW elsewhere)
    name: str = "adamw"
    #: peak learning rate
    lr: float = 3e-4
    #: Adam beta1
    beta1: float = 0.9
    #: Adam beta2
    beta2: float = 0.95
    #: Adam epsilon
    eps: float = 1e-8
    #: decoupled weight decay on matrices
    weight_decay: float = 0.1
    #: muon only: momentum coefficient of the hidden matrices
    momentum: float = 0.95
    #: muon only: Nesterov momentum (orthogonalise grad + momentum * buffer)
    nesterov: bool = True
    #: muon only: Newton-Schulz iterations
    ns_steps: int = 5
    #: muon only: dtype of the Newton-Schulz iteration, "float32" or "bfloat16"
    ns_dtype: str = "float32"
    #: muon only: globs over parameter FQNs also left to AdamW (beside embeddings, the head, 1-D params)
    adamw_params: list[str] = dataclasses.field(default_factory=list)
    #: muon only: globs over parameter FQNs orthogonalised per head (each head_dim-row block its own
    #: Newton-Schulz, e.g. "layers.*.attention.wq.weight"); empty: whole matrices
    muon_per_head: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str = "optimizer") -> None:
        require_choice(self.name, ["adamw", "muon"], f"{path}.name")
        require_positive(self.lr, f"{path}.lr")
        require(0 <= self.beta1 < 1, f"{path}.beta1", f"must be in [0, 1), got {self.beta1}")
        require(0 <= self.beta2 < 1, f"{path}.beta2", f"must be in [0, 1), got {self.beta2}")
        require_positive(self.eps, f"{path}.eps")
        require(self.weight_decay >= 0, f"{path}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(0 <= self.momentum < 1, f"{path}.momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.ns_steps >= 1, f"{path}.ns_steps", f"must be >= 1, got {self.ns_steps}")
        require_choice(self.ns_dtype, ["float32", "bfloat16"], f"{path}.ns_dtype")
        require(self.name == "muon" or not self.adamw_params, f"{path}.adamw_params",
                f"only applies to name='muon', got name={self.name!r}")
        require(self.name == "muon" or not self.muon_per_head, f"{path}.muon_per_head",
                f"only applies to name='muon', got name={self.name!r}")

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.name == "muon":
            from lockstep.train.muon import build_muon

            return build_muon(self, model)
        # Groups by (decays?, is a DTensor?): one fused kernel call per group may not mix sharded
        # and plain tensors (expert-parallel weights stay plain beside FSDP's DTensors).
        buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for param in model.parameters():
            if param.requires_grad:
                key = (param.ndim >= 2, hasattr(param, "device_mesh"))
                buckets.setdefault(key, []).append(param)
        groups = [{"params": params, "weight_decay": self.weight_decay if decays else 0.0}
                  for (decays, _), params in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
        # The fused kernel (CPU and CUDA) is elementwise per parameter: fast and deterministic.
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                                      fused=True)
        optimizer.register_step_post_hook(_mark_parameters_written)
        return optimizer


#: the name recipes and tests have always used; the same config (``name`` defaults to "adamw")
AdamWConfig = OptimizerConfig


def _mark_parameters_written(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The fused AdamW kernel writes the parameters without moving their version counters (torch
    2.13); copies made from the weights (the engine's bf16 cast and packed weights) use those
    counters to know they are stale, so move them here."""
    increment_version([p for group in optimizer.param_groups for p in group["params"]])


@dataclasses.dataclass(kw_only=True)
class LRScheduleConfig(Config):
    """Learning rate as a function of step: linear warmup, then a decay shape."""

    #: "cosine" (warmup then cosine to min), "wsd" (warmup, stable, then linear decay), "constant"
    kind: str = "cosine"
    #: steps of linear warmup from 0 to the peak
    warmup_steps: int = 20
    #: final lr as a fraction of the peak
    min_lr_ratio: float = 0.1
    #: wsd only: fraction of all steps spent in the final decay
    decay_fraction: float = 0.2

    def validate(self, path: str = "lr_schedule") -> None:
        require_choice(self.kind, ["cosine", "wsd", "constant"], f"{path}.kind")
        require(self.warmup_steps >= 0, f"{path}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(0 <= self.min_lr_ratio <= 1, f"{path}.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(0 < self.decay_fraction <= 1, f"{path}.decay_fraction",
                f"must be in (0, 1], got {self.decay_fraction}")

    def build(self, *, peak_lr: float, total_steps: int) -> Callable[[int], float]:
        """lr(step) for steps 1..total_steps."""
        return lambda step: peak_lr * lr_multiplier(self, step, total_steps)


def lr_multiplier(cfg: LRScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak lr at 1-based ``step``."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if warmup and step <= warmup:
        return step / warmup
    if cfg.kind == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.kind == "cosine":
        span = max(total_steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(int(round(cfg.decay_fraction * total_steps)), 1)
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    return 1.0 - (1.0 - floor) * progress
