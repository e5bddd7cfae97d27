"""Batch-invariant linears on tensor-parallel shards, and the fixed-order sum of their partials.

:func:`lockstep.ops.batch_invariant.linear` hands a DTensor weight (a layer of the TP styles of
:mod:`lockstep.parallel`) to :func:`sharded_linear`: the invariant kernel on the local shards, a
column-parallel layer's columns as one process computes them, a row-parallel layer's partials
pending an :class:`OrderedSum`, which the styles' output hooks reduce by :func:`tree_sum` in rank
order -- never in the backend's ring or tree order. Which layout pairs then agree bitwise:
docs/numerics.md and :mod:`lockstep.parallel.tp_sums`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lockstep import numerics

#: ``(x, weight, bias, k_split) -> x @ weight.T + bias`` on plain tensors, batch-invariant
LocalLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` added pairwise, level by level (``(p0 + p1) + (p2 + p3)``; an odd last one carried
    up): with ``n * m`` parts, ``m`` a power of two, the first levels sum each aligned group of ``m``
    and the rest are the tree over the ``n`` group sums. So a sum over ``n`` ranks of each rank's
    ``m``-way split equals one process's ``n * m``-way split, bit for bit."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


class OrderedSum(Partial):
    """A pending sum over a 1-D mesh reduced in a fixed order: every rank all-gathers the partials
    and adds them by :func:`tree_sum` in rank order, so the bits do not depend on the backend's ring
    or tree order (NCCL's depends on the rank count and message size; at 2 ranks every order is
    ``a + b``). A row-parallel batch-invariant linear's output carries it, and so does an expert-TP
    MoE layer's partial output (:func:`lockstep.parallel.tp_blocks.moe_plan`); the TP styles' output
    hooks reduce it (to ``Replicate``, or to ``Shard`` under sequence parallelism: the same sum, then
    this rank's chunk). Outside batch-invariant mode it is a plain ``Partial`` sum (the backend's
    all-reduce / reduce-scatter)."""

    def __init__(self) -> None:
        super().__init__("sum")

    def _reduce_value(self, tensor: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
        if not numerics.is_batch_invariant():
            return super()._reduce_value(tensor, mesh, mesh_dim)
        group = mesh.get_group(mesh_dim)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return tree_sum(parts)

    def _reduce_shard_value(self, tensor: torch.Tensor, mesh, mesh_dim: int, shard_spec) -> torch.Tensor:
        if not numerics.is_batch_invariant():
            return super()._reduce_shard_value(tensor, mesh, mesh_dim, shard_spec)
        whole = self._reduce_value(tensor, mesh, mesh_dim)
        return whole.chunk(mesh.size(mesh_dim), dim=shard_spec.dim)[mesh.get_local_rank(mesh_dim)].contiguous()

    def __eq__(self, other: object) -> bool:
        return type(other) is OrderedSum

    def __hash__(self) -> int:
        return hash("OrderedSum")

    def __repr__(self) -> str:
        return "OrderedSum()"

    __str__ = __repr__


def sharded_linear(x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None, k_split: int,
                   local: LocalLinear) -> torch.Tensor:
    """The batch-invariant linear of a tensor-parallel layer (a weight on a 1-D mesh, as the TP
    styles of :mod:`lockstep.parallel` leave it): ``local`` (the batch-invariant linear of plain
    tensors) on the local shards, so each rank computes exactly what a one-process call of the
    local shapes would. Column-parallel (``Shard(0)``): the local output columns, ``Shard(-1)``:
    bitwise the one-process linear's columns (each output is its own dot product over all of K).
    Row-parallel (``Shard(1)``): the partial dot products over this rank's slice of K (``k_split``
    ways; the bias joins rank 0's), pending an :class:`OrderedSum`. ``x`` is what the style's input
    hook made: a DTensor (replicated, or sharded on its last dim) or a plain local tensor.
    Gradients flow as for ``F.linear`` on DTensors."""
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements not in ((Shard(0),), (Shard(1),)):
        raise NotImplementedError(f"batch-invariant linear: a weight sharded {placements} on a {mesh.ndim}-D mesh; "
                                  "tensor-parallel layers (Shard(0) or Shard(1) on the tp mesh) only")
    if placements == (Shard(0),):  # column-parallel: the input replicated (its gradient a partial sum)
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        if isinstance(bias, DTensor):
            bias = bias.to_local()
        out = local(x, weight.to_local(), bias, 1)
        return DTensor.from_local(out, mesh, [Shard(out.ndim - 1)], run_check=False)
    if isinstance(x, DTensor):  # row-parallel: the input sharded on its last dim
        x = x.redistribute(placements=[Shard(x.ndim - 1)]).to_local()
    if bias is not None:  # on every rank (its gradient path), zero but on rank 0
        bias = bias.to_local(grad_placements=[Partial()]) if isinstance(bias, DTensor) else bias
        bias = bias * float(mesh.get_local_rank() == 0)
    out = local(x, weight.to_local(), bias, k_split)
    return DTensor.from_local(out, mesh, [OrderedSum()], run_check=False)
