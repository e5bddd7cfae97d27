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
    a FlexShard parameter's (``param._flex``) squares are summed over its group (each rank holds
    other pieces; a replicated copy under HSDP is not summed again); a plain gradient is the same on
    every rank, so its local norm is already global.
    """
    params = list(params)
    flex = [p for p in params if hasattr(p, "_flex")]
    plain = [p.grad for p in params if p.grad is not None and not hasattr(p, "_flex")]
    squares = _flex_squares(flex)
    if not plain and not squares:
        return torch.zeros(())
    for g in plain:
        norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm * norm)
    total = torch.stack(squares).sum().sqrt()
    grads = plain + [p.grad for p in flex if p.grad is not None]
    if math.isfinite(max_norm):
        scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for g in grads:
            g.mul_(scale)
    return total


def _flex_squares(flex: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Sum of squares of FlexShard gradients, one all-reduce per process group (a collective: every
    rank of a group passes the same parameters)."""
    import torch.distributed as dist

    by_group: dict[int, tuple[object, int, list[torch.Tensor]]] = {}
    for p in flex:
        lay = p._flex
        group, world, terms = by_group.setdefault(id(lay.group), (lay.group, lay.world, []))
        if p.grad is not None and p.grad.numel():
            terms.append(torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32) ** 2)
    out = []
    for group, world, terms in by_group.values():
        total = torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float32)
        if world > 1:
            dist.all_reduce(total, group=group)
        out.append(total)
    return out
