"""Which part of each global tensor a rank holds, and copying saved chunks into another layout.

A ``Slot`` is one state tensor as this rank sees it: the local data and where it sits in the
global tensor (global shape + per-dimension offsets). DTensors (FSDP, TP) describe themselves;
plain tensors are whole unless the caller says otherwise (expert-parallel weights are a slice of
the expert dimension). Saving writes each distinct chunk once (the lowest rank holding it);
loading copies the overlap of every saved chunk with every local slot, so any layout loads any
other exactly.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import DTensor


@dataclasses.dataclass
class Slot:
    """A rank's piece of one global tensor (``tensor`` is written on save and filled on load)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> "Slot":
        if isinstance(t, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = t.to_local()
            shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if tuple(local.shape) != tuple(shape):
                raise ValueError(f"DTensor local shape {tuple(local.shape)} != expected {tuple(shape)}")
            return cls(local, tuple(t.shape), tuple(int(o) for o in offsets))
        return cls(t, tuple(t.shape), (0,) * t.ndim)

    @classmethod
    def row_slice(cls, t: torch.Tensor, global_rows: int, row_offset: int) -> "Slot":
        """A plain tensor that is rows ``row_offset..`` of a ``[global_rows, ...]`` tensor (or a DTensor
        of those rows, e.g. expert-parallel experts also split over tp on another dim)."""
        if isinstance(t, DTensor):
            inner = cls.of(t)
            return cls(inner.tensor, (global_rows, *inner.global_shape[1:]),
                       (row_offset + inner.offsets[0], *inner.offsets[1:]))
        return cls(t, (global_rows, *t.shape[1:]), (row_offset,) + (0,) * (t.ndim - 1))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def signature(self) -> tuple:
        return (self.global_shape, self.offsets, self.shape, self.tensor.dtype)


def owned_chunks(all_ranks: list[dict[str, tuple]], rank: int) -> list[str]:
    """Names whose chunk this rank writes: those no lower rank holds with the same offsets/shape
    (replicas - data-parallel copies, replicated buffers - are written once)."""
    seen: dict[tuple, int] = {}
    for r, table in enumerate(all_ranks):
        for name, (global_shape, offsets, shape, _dtype) in table.items():
            seen.setdefault((name, offsets, shape), r)
    return sorted(name for name, (_g, offsets, shape, _d) in all_ranks[rank].items()
                  if seen[(name, offsets, shape)] == rank)


def _overlap(a_off, a_shape, b_off, b_shape) -> tuple[tuple[int, int], ...] | None:
    box = []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        box.append((lo, hi))
    return tuple(box)


def copy_overlap(dst: Slot, src: torch.Tensor, src_offsets: tuple[int, ...]) -> int:
    """Copy the part of a saved chunk that falls inside ``dst``; returns elements copied."""
    if dst.tensor.ndim == 0:
        with torch.no_grad():
            dst.tensor.copy_(src.reshape(()))
        return 1
    box = _overlap(dst.offsets, dst.shape, src_offsets, tuple(src.shape))
    if box is None:
        return 0
    dst_index = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, dst.offsets))
    src_index = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, src_offsets))
    with torch.no_grad():
        dst.tensor[dst_index].copy_(src[src_index])
    return math.prod(hi - lo for lo, hi in box)
