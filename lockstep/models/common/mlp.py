"""Feed-forward layers: the SwiGLU MLP and the base config every feed-forward kind derives from."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import numerics
from lockstep.compile.local import local_compile
from lockstep.config.base import Config


@dataclasses.dataclass(kw_only=True)
class FeedForwardConfig(Config):
    """Base of feed-forward configs (dense MLPs now, mixtures of experts later)."""

    slot_kind: ClassVar[type]

    def build(self, *, dim: int, hidden_dim: int) -> nn.Module:  # noqa: D102
        raise NotImplementedError


FeedForwardConfig.slot_kind = FeedForwardConfig


@dataclasses.dataclass(kw_only=True)
class SwiGLUConfig(FeedForwardConfig):
    """w2(silu(w1 x) * w3 x), the Llama/Qwen MLP."""

    def build(self, *, dim: int, hidden_dim: int) -> "SwiGLU":
        return SwiGLU(dim, hidden_dim)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_activation(self.w1(x), self.w3(x)))


@local_compile("swiglu")
def swiglu_activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU gating (rowwise: batch-invariant mode). The region holds the
    elementwise part only: the projections stay module calls, so tensor parallel's and FSDP's hooks
    on them run as in eager."""
    return numerics.rowwise(F.silu, gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)`` (transformers' ``GptOssExperts._apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * numerics.rowwise(torch.sigmoid, gate * alpha))
