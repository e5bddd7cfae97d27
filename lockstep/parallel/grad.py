"""Gradient clipping that works for any mix of DTensor (FSDP/TP) and plain parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before.

    A DTensor gradient's norm is computed on its shards and reduced over its mesh (``full_tensor``);
    a plain gradient is the same on every rank, so its local norm is already global.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm * norm)
    total = torch.stack(squares).sum().sqrt()
    if math.isfinite(max_norm):
        scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for g in grads:
            g.mul_(scale)
    return total
