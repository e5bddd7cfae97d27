"""Resharding weight sync, the plan: which slice of which tensor goes from which trainer rank to which
generator rank, from the two sides' layouts alone (nobody gathers the model).

- :func:`describe` says where each tensor of a model's state lives: its global shape and dtype, the
  global ranks of its mesh and the placements on it (a DTensor's own; a plain tensor is whole on
  every rank of the side that holds it). Descriptions are small, picklable and exchanged once
  (:func:`exchange_layouts`).
- :class:`ReshardPlan` is computed on every rank from the two descriptions alone (shapes +
  placements), so every rank gets the same plan: a list of :class:`Piece` (source rank, destination
  rank, tensor, the source's local slice, the destination's local slice). Each destination region
  is read from one source; where several source ranks hold it (replicas: HSDP, TP-replicated norms,
  a plain tensor on every trainer rank) the destinations are spread over them.

:mod:`lockstep.rl.reshard_transfer` moves the pieces. Placements understood: ``Shard(d)`` (torch's
chunking: ``ceil(n / k)`` rows a rank, the last ones short or empty; several on one dim apply left to
right, DTensor's default order) and ``Replicate``; ``Partial`` and ``_StridedShard`` (FSDP over TP) are
refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Box = tuple[tuple[int, int], ...]  # per dim [start, stop) in global coordinates


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lives: its global shape and dtype, its mesh (global ranks, row-major) and placements."""

    shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    #: one per mesh dim: ("S", dim) or ("R",)
    placements: tuple[tuple, ...]

    def box(self, rank: int) -> Box | None:
        """The global region ``rank`` holds (None: not on the mesh, or an empty shard)."""
        if rank not in self.mesh_ranks:
            return None
        coords = _unravel(self.mesh_ranks.index(rank), self.mesh_shape)
        box = [(0, n) for n in self.shape]
        for placement, coord, size in zip(self.placements, coords, self.mesh_shape):
            if placement[0] != "S":
                continue
            start, stop = box[placement[1]]
            chunk = -(-(stop - start) // size)
            box[placement[1]] = (min(start + coord * chunk, stop), min(start + (coord + 1) * chunk, stop))
        if any(stop <= start for start, stop in box) and self.shape:
            return None
        return tuple(box)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return tuple(reversed(coords))


def _placement(p: Any, name: str, ndim: int) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    kind = type(p).__name__
    if kind == "_StridedShard" or (isinstance(p, Shard) and type(p) is not Shard):
        raise ValueError(f"weight sync: {name} has placement {p!r} (FSDP over TP), which resharding does not read")
    if isinstance(p, Shard):
        return ("S", p.dim % ndim)
    if isinstance(p, Replicate):
        return ("R",)
    raise ValueError(f"weight sync: {name} has placement {p!r}; resharding reads Shard and Replicate only")


def unique_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the state dict sorted by name, each tensor once (tied weights: the first name);
    DTensors stay DTensors (their local shard decides what is shared)."""
    seen, out = set(), []
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        local = local_tensor(tensor)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor itself), detached."""
    local = getattr(tensor, "_local_tensor", None)
    return (tensor if local is None else local).detach()


def describe(model: nn.Module, ranks: list[int]) -> dict[str, TensorLayout]:
    """Where each state tensor of this side's ``model`` lives; ``ranks``: this side's global ranks (a
    plain tensor is whole on each of them). Every rank of the side gives the same answer."""
    out = {}
    for name, tensor in unique_state(model):
        dtype = str(tensor.dtype).removeprefix("torch.")
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is None:
            out[name] = TensorLayout(tuple(tensor.shape), dtype, (len(ranks),), tuple(ranks), (("R",),))
            continue
        placements = tuple(_placement(p, name, max(tensor.ndim, 1)) for p in tensor.placements)
        out[name] = TensorLayout(tuple(tensor.shape), dtype, tuple(mesh.mesh.shape),
                                 tuple(int(r) for r in mesh.mesh.flatten().tolist()), placements)
    return out


@dataclasses.dataclass(frozen=True)
class Piece:
    """One region of one tensor going from ``src`` to ``dst`` (slices local to each side's shard)."""

    src: int
    dst: int
    name: str
    src_slices: tuple[tuple[int, int], ...]
    dst_slices: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


class ReshardPlan:
    """Every piece moving from the source layout to the destination layout (the same on every rank)."""

    def __init__(self, source: dict[str, TensorLayout], dest: dict[str, TensorLayout]) -> None:
        if source.keys() != dest.keys():
            missing, extra = sorted(dest.keys() - source.keys()), sorted(source.keys() - dest.keys())
            raise ValueError(f"weight sync: the two models' states differ (only the generator's: {missing[:5]}, "
                             f"only the trainer's: {extra[:5]})")
        self.pieces: list[Piece] = []
        self.full_bytes = 0
        for name in sorted(dest):
            both = set(source[name].mesh_ranks) & set(dest[name].mesh_ranks)
            if both:
                raise ValueError(f"weight sync: ranks {sorted(both)} hold {name} on both sides; the trainer's "
                                 f"and the generators' ranks must differ")
            src, dst = source[name], dest[name]
            if (src.shape, src.dtype) != (dst.shape, dst.dtype):
                raise ValueError(f"weight sync: {name} is {src.dtype}{list(src.shape)} on the trainer but "
                                 f"{dst.dtype}{list(dst.shape)} on the generator")
            self.full_bytes += Piece(0, 0, name, (), (), src.shape, src.dtype).nbytes
            self.pieces.extend(_pieces(name, src, dst))

    def sends(self, rank: int) -> dict[int, list[Piece]]:
        """Destination rank -> the pieces ``rank`` sends it, in plan order."""
        out: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            if piece.src == rank:
                out.setdefault(piece.dst, []).append(piece)
        return out

    def receives(self, rank: int) -> dict[int, list[Piece]]:
        """Source rank -> the pieces ``rank`` receives from it, in plan order."""
        out: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            if piece.dst == rank:
                out.setdefault(piece.src, []).append(piece)
        return out

    def bytes_sent(self, rank: int) -> int:
        """Payload bytes ``rank`` sends per version (headers and alignment not counted)."""
        return sum(p.nbytes for p in self.pieces if p.src == rank)


def _pieces(name: str, src: TensorLayout, dst: TensorLayout) -> list[Piece]:
    holders: dict[Box, list[int]] = {}  # distinct source regions (they tile the tensor) -> replicas
    for rank in src.mesh_ranks:
        box = src.box(rank)
        if box is not None:
            holders.setdefault(box, []).append(rank)
    out = []
    dst_ranks = [r for r in dst.mesh_ranks if dst.box(r) is not None]
    for k, rank in enumerate(dst_ranks):
        dbox = dst.box(rank)
        for sbox, replicas in holders.items():
            inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(sbox, dbox))
            if any(stop <= start for start, stop in inter):
                continue
            source = replicas[k % len(replicas)]  # spread the destinations over the replicas
            out.append(Piece(source, rank, name,
                             tuple((a - s, b - s) for (a, b), (s, _) in zip(inter, sbox)),
                             tuple((a - s, b - s) for (a, b), (s, _) in zip(inter, dbox)),
                             tuple(b - a for a, b in inter), src.dtype))
    return out


def exchange_layouts(mine: dict[str, TensorLayout] | None, group: Any = None) -> list[dict[str, TensorLayout]]:
    """Every rank's description (``None`` from ranks that describe nothing), gathered on every rank of
    ``group``: each side learns the other's layout once, then computes the plan locally."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def side_layout(described: list[dict[str, TensorLayout] | None], ranks: list[int],
                group_ranks: list[int]) -> dict[str, TensorLayout]:
    """The description of the side made of global ``ranks`` (the first of them that gave one;
    ``group_ranks``: the global rank of each entry of ``described``)."""
    for rank in ranks:
        entry = described[group_ranks.index(rank)]
        if entry is not None:
            return entry
    raise ValueError(f"weight sync: none of the ranks {ranks} described its model")


__all__ = ["Piece", "ReshardPlan", "TensorLayout", "describe", "exchange_layouts", "local_tensor", "side_layout",
           "unique_state"]
