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
right, DTensor's default order), ``Replicate`` and FSDP2-over-TP's ``_StridedShard(d)`` (FSDP chunks
the tensor-parallel shard: applied after the plain ``Shard`` placements of the same dim, whose degrees
its ``split_factor`` must be); ``Partial`` is refused by name. A trainer's expert-parallel experts
(:class:`~lockstep.parallel.expert.ExpertParallelExperts`: tensors holding ``E / ep`` experts) are
described as ``Shard(0)`` over the ``ep`` dim of the trainer's mesh (``describe(..., mesh=)``), then by
their own DTensor placements (expert TP's hidden-dim shard under tp x ep, HSDP's replicas under
dp_replicate x ep: any replica is a source). An ep x tp generation group's experts are DTensors on its
``("ep", "tp")`` mesh; its TP weights, on one ep row's tp ranks, are described on the whole grid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.generate.parallel import group_of

Box = tuple[tuple[int, int], ...]  # per dim [start, stop) in global coordinates


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lives: its global shape and dtype, its mesh (global ranks, row-major) and placements."""

    shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    #: one per mesh dim: ("S", dim), ("SS", dim) (strided: FSDP over TP) or ("R",)
    placements: tuple[tuple, ...]

    def box(self, rank: int) -> Box | None:
        """The global region ``rank`` holds (None: not on the mesh, or an empty shard)."""
        if rank not in self.mesh_ranks:
            return None
        coords = _unravel(self.mesh_ranks.index(rank), self.mesh_shape)
        box = [(0, n) for n in self.shape]
        # plain shards left to right, then the strided ones (FSDP's chunk of the tensor-parallel shard)
        order = [i for i, p in enumerate(self.placements) if p[0] == "S"] + \
                [i for i, p in enumerate(self.placements) if p[0] == "SS"]
        for i in order:
            placement, coord, size = self.placements[i], coords[i], self.mesh_shape[i]
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


def _placements(tensor: Any, name: str) -> tuple[tuple, ...]:
    """A DTensor's placements as ("S", d) / ("SS", d) / ("R",); a strided shard must be FSDP's over the
    later plain shards of its dim (``split_factor`` = their degrees)."""
    ndim = max(tensor.ndim, 1)
    out = tuple(_placement(p, name, ndim) for p in tensor.placements)
    sizes = tuple(tensor.device_mesh.mesh.shape)
    for i, p in enumerate(tensor.placements):
        if out[i][0] != "SS":
            continue
        later = 1
        for j in range(i + 1, len(out)):
            later *= sizes[j] if out[j] == ("S", out[i][1]) else 1
        if getattr(p, "split_factor", None) != later:
            raise ValueError(f"weight sync: {name} has placement {p!r} on mesh {sizes} with placements "
                             f"{tensor.placements}; resharding reads a strided shard over the later shards of its "
                             f"dim only (FSDP over TP)")
    return out


def _placement(p: Any, name: str, ndim: int) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    kind = type(p).__name__
    if kind == "_StridedShard":
        return ("SS", p.dim % ndim)
    if isinstance(p, Shard) and type(p) is not Shard:
        raise ValueError(f"weight sync: {name} has placement {p!r}, which resharding does not read")
    if isinstance(p, Shard):
        return ("S", p.dim % ndim)
    if isinstance(p, Replicate):
        return ("R",)
    raise ValueError(f"weight sync: {name} has placement {p!r}; resharding reads Shard and Replicate only")


def _pipeline_parts(model: nn.Module) -> list[nn.Module] | None:
    """A pipeline rank's stages (the ModuleList ``ParallelRuntime.parallelize`` returns under pp), else None."""
    from lockstep.parallel.pipeline_stage import PipelineStageModule

    if isinstance(model, nn.ModuleList) and len(model) and all(isinstance(p, PipelineStageModule) for p in model):
        return list(model)
    return None


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state by the unsplit model's names. A pipeline rank's stages keep those names; their states are
    merged, and under a tied head the first stage's embedding copy is left out (the unsplit model's one
    tensor goes by ``output.weight``, the first name in sorted order: the last stage's copy is read)."""
    parts = _pipeline_parts(model)
    if parts is None:
        return model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part.state_dict(keep_vars=True))
    if parts[0].config.tie_embeddings:
        out.pop("tok_embeddings.weight", None)
    return out


def _stage_mesh(mesh: Any) -> tuple[Any, list[int]] | None:
    """Under a pipeline (a ``pp`` dim, outermost): the mesh of this rank's stages (the other dims; None
    when pp is the only one) and the global ranks holding them; None without a pipeline."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names:
        return None
    ranks = [int(r) for r in mesh.mesh[mesh["pp"].get_local_rank()].flatten().tolist()]
    rest = tuple(n for n in names if n != "pp")
    return (mesh[rest] if rest else None), ranks


def unique_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the state dict sorted by name, each tensor once (tied weights: the first name);
    DTensors stay DTensors (their local shard decides what is shared). A pipeline rank's stages: their
    tensors by the unsplit model's names (:func:`_state`)."""
    seen, out = set(), []
    for name, tensor in sorted(_state(model).items()):
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


def _expert_tensors(model: nn.Module) -> dict[str, int]:
    """State name -> E (the global expert count) of each tensor an ExpertParallelExperts holds a slice of."""
    from lockstep.parallel.expert import ExpertParallelExperts, expert_tensor_names

    return {f"{prefix}.{n}": m.n_global_experts for part in _pipeline_parts(model) or [model]
            for prefix, m in part.named_modules() if isinstance(m, ExpertParallelExperts)
            for n in expert_tensor_names(m)}


def describe(model: nn.Module, ranks: list[int], mesh: Any = None) -> dict[str, TensorLayout]:
    """Where each state tensor of this side's ``model`` lives; ``ranks``: this side's global ranks (a
    plain tensor is whole on each of them). ``mesh``: the trainer's DeviceMesh when its experts are
    expert-parallel (:class:`~lockstep.parallel.expert.ExpertParallelExperts`: split over its ``ep``
    dim, then by their own DTensor placements: expert TP's hidden dim, FSDP over replicas). Another
    DTensor is described on its own mesh (a trainer's router FSDP-sharded over dp only: those ranks
    cover it), except on an ep x tp generation group (:func:`~lockstep.generate.parallel.group_of`),
    whose TP weights are on every ep row: every rank must receive them. Under a pipeline (a ``pp`` dim) each rank describes its own stages' tensors, a plain
    one whole on the ranks of its stage (:func:`side_layout` merges the stages); otherwise every rank of
    the side gives the same answer."""
    stage = _stage_mesh(mesh)
    if stage is not None:  # a pipeline: this rank's stages, on the ranks (and dims) of its pp index
        mesh, ranks = stage
    experts = _expert_tensors(model)
    generation = group_of(model)
    grid = generation.mesh if generation is not None and generation.mesh.ndim > 1 else None
    if experts and (mesh is None or "ep" not in (mesh.mesh_dim_names or ())):
        raise ValueError("weight sync: the model's experts are expert-parallel; describe() needs the mesh with "
                         "their 'ep' dim")
    out = {}
    for name, tensor in unique_state(model):
        dtype = str(tensor.dtype).removeprefix("torch.")
        tensor_mesh = getattr(tensor, "device_mesh", None)
        if name in experts:
            out[name] = _expert_layout(name, tensor, experts[name], dtype, mesh)
        elif tensor_mesh is None:
            out[name] = TensorLayout(tuple(tensor.shape), dtype, (len(ranks),), tuple(ranks), (("R",),))
        elif grid is not None and tensor_mesh.size() < grid.size():  # an ep x tp generator's TP weight: the
            # same on every ep row (each rank a destination); a trainer's sub-mesh holders cover the tensor
            out[name] = TensorLayout(tuple(tensor.shape), dtype, tuple(grid.mesh.shape), _ranks(grid),
                                     _on_side_mesh(tensor, name, grid, {"ep": ("R",)}))
        else:
            out[name] = TensorLayout(tuple(tensor.shape), dtype, tuple(tensor_mesh.mesh.shape), _ranks(tensor_mesh),
                                     _placements(tensor, name))
    return out


def _ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _on_side_mesh(tensor: Any, name: str, mesh: Any, fixed: dict[str, tuple]) -> tuple[tuple, ...]:
    """The placements over the side's ``mesh`` of a tensor held on a slice of it: ``fixed`` ones by dim
    name, then the tensor's own DTensor placements on its dims; a dim of size 1 is ``Replicate``, and
    any other dim the tensor is not on is refused (its ranks might hold other tensors: pipeline stages)."""
    names = tuple(mesh.mesh_dim_names or ())
    own: dict[str, tuple] = {}
    sub = getattr(tensor, "device_mesh", None)
    if sub is not None:
        sub_names = tuple(sub.mesh_dim_names or ())
        if not set(sub_names) <= set(names) or mesh[sub_names].mesh.tolist() != sub.mesh.tolist():
            raise ValueError(f"weight sync: {name} is held on mesh {sub} (dims {sub_names}), which is not a slice of "
                             f"the side's mesh {mesh} (dims {names}); resharding cannot place it")
        own = dict(zip(sub_names, _placements(tensor, name)))
    out = []
    for dim_name, size in zip(names, mesh.mesh.shape):
        placement = fixed.get(dim_name) or own.get(dim_name) or (("R",) if size == 1 else None)
        if placement is None:
            raise ValueError(f"weight sync: {name} is not on the side mesh's {dim_name} dim ({int(size)} ranks), "
                             f"which resharding reads only for the tensors that dim splits or replicates")
        out.append(placement)
    return tuple(out)


def _expert_layout(name: str, tensor: Any, n_global: int, dtype: str, mesh: Any) -> TensorLayout:
    """An expert-parallel tensor (``E / ep`` experts a rank): ``Shard(0)`` over the mesh's ep dim, then
    its own DTensor placements (expert TP's hidden-dim shard, FSDP over replicas of the same experts)."""
    placements = _on_side_mesh(tensor, name, mesh, {"ep": ("S", 0)})
    for dim_name, size, placement in zip(mesh.mesh_dim_names, mesh.mesh.shape, placements):
        if dim_name != "ep" and placement[0] != "R" and placement[1] == 0 and size > 1:
            raise ValueError(f"weight sync: {name} is expert-parallel and split on its expert dim over "
                             f"{dim_name} as well (experts FSDP-sharded: ep < dp_shard), which resharding does "
                             f"not read")
    return TensorLayout((n_global, *tensor.shape[1:]), dtype, tuple(mesh.mesh.shape), _ranks(mesh), placements)


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
    """The description of the side made of global ``ranks``: their descriptions merged, the first rank's
    entry of a name kept (pipeline stages each describe their own tensors; other layouts' ranks give the
    same answer); ``group_ranks``: the global rank of each entry of ``described``."""
    merged: dict[str, TensorLayout] = {}
    for rank in ranks:
        entry = described[group_ranks.index(rank)]
        for name, layout in (entry or {}).items():
            merged.setdefault(name, layout)
    if not merged:
        raise ValueError(f"weight sync: none of the ranks {ranks} described its model")
    return merged


__all__ = ["Piece", "ReshardPlan", "TensorLayout", "describe", "exchange_layouts", "local_tensor", "side_layout",
           "unique_state"]
