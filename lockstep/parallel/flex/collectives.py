"""The two collectives FlexShard issues, looked up on ``torch.distributed`` at call time (a test that
wraps them to count bytes on the wire sees every call).

Both move flat 1-D buffers: ``all_gather_flat`` ``[S] -> [W*S]``, ``reduce_scatter_flat`` ``[W*S] ->
[S]`` (sum). gloo has no float8: FP8 payloads travel as ``uint8``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(send: torch.Tensor, world: int, group, async_op: bool = False):
    """``[S]`` on each rank -> ``[W*S]`` (rank r's at ``[r*S, (r+1)*S)``); with ``async_op`` returns
    ``(out, work)`` (``work.wait()`` before reading ``out``)."""
    out = send.new_empty(world * send.numel())
    work = _gather_fn()(out, send, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_flat(send: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[W*S]`` on each rank -> ``[S]``: the sum over ranks of their slot ``r`` on rank ``r``."""
    out = send.new_empty(send.numel() // world)
    _reduce_scatter_fn()(out, send, op=dist.ReduceOp.SUM, group=group)
    return out
