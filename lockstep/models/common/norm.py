"""Normalisation layers (RMSNorm) and their configs."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.compile.local import local_compile
from lockstep.config.base import Config, require_positive


@dataclasses.dataclass(kw_only=True)
class NormConfig(Config):
    """Base of every norm config: any norm can replace any other through an override."""

    slot_kind: ClassVar[type]

    def build(self, *, dim: int, eps: float) -> nn.Module:  # noqa: D102
        raise NotImplementedError


NormConfig.slot_kind = NormConfig


@dataclasses.dataclass(kw_only=True)
class RMSNormConfig(NormConfig):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    #: epsilon override; 0 uses the model's norm_eps
    eps: float = 0.0

    def validate(self, path: str = "") -> None:
        if self.eps:
            require_positive(self.eps, f"{path}.eps")

    def build(self, *, dim: int, eps: float) -> "RMSNorm":
        return RMSNorm(dim, self.eps or eps)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised in fp32 and cast back (as the HF reference does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclasses.dataclass(kw_only=True)
class ZeroCenteredRMSNormConfig(NormConfig):
    """RMSNorm whose stored weight is the scale minus one (Gemma, Qwen3-Next, Qwen3.5): zeros at init."""

    #: epsilon override; 0 uses the model's norm_eps
    eps: float = 0.0

    def validate(self, path: str = "") -> None:
        if self.eps:
            require_positive(self.eps, f"{path}.eps")

    def build(self, *, dim: int, eps: float) -> "ZeroCenteredRMSNorm":
        return ZeroCenteredRMSNorm(dim, self.eps or eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + weight), all in fp32 and cast back (as Hugging Face's Qwen3-Next)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


@local_compile("rmsnorm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``, normalised in fp32 and cast back to ``x``'s dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@local_compile("rmsnorm")
def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x / rms(x)) * (1 + weight)``, all in fp32, cast back to ``x``'s dtype."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)
