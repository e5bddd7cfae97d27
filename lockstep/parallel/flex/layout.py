"""FlexShard placements, buckets and the per-parameter contract (:class:`FlexParam`).

A parameter managed by :func:`lockstep.parallel.flex.flex_shard` is a plain ``nn.Parameter`` holding
this rank's local storage (only the real rows/elements it holds, possibly none) and carries
``param._flex``, a :class:`FlexParam` saying where that storage sits in the whole parameter. The
optimizer, gradient clipping and checkpoints read it (see /tmp/brief contract, mirrored here):

- ``Shard(dim)``: ``torch.chunk``-style pieces along ``dim`` (chunk ``ceil(n / W)``; the last ranks
  may get fewer or none), as FSDP2/DTensor ``Shard``.
- ``Owned()``: the whole parameter on one rank (``owner``); the others hold ``(0, *shape[1:])``.
  Owners come from :func:`assign_owners` (greedy by Newton-Schulz cost).
- ``BlockShard(dim, block)``: ``T = ceil(n / block)`` blocks, each rank ``k = ceil(T / W)``
  consecutive ones (:func:`lockstep.parallel.fp8_gather.block_shard_rows`); ``Shard`` is the
  ``block = 1`` case of the same rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from lockstep.parallel.fp8_gather import block_shard_rows


@dataclasses.dataclass(frozen=True)
class Shard:
    """torch.chunk-style pieces along ``dim``; all-gathered before use, gradients reduce-scattered."""

    dim: int = 0

    name = "shard"


@dataclasses.dataclass(frozen=True)
class Owned:
    """The whole parameter on one rank (load-balanced); gradients reduced to the owner."""

    name = "owned"


@dataclasses.dataclass(frozen=True)
class BlockShard:
    """Whole blocks of ``block`` rows (along ``dim``) per rank; the wire slot is ``k * block`` rows."""

    dim: int = 0
    block: int = 128

    name = "block_shard"


Placement = Shard | Owned | BlockShard


@dataclasses.dataclass
class Bucket:
    """Parameters whose clean FQNs match one of ``patterns`` (``fnmatch`` globs), placed alike.

    ``mesh_dim``: the mesh dimension the bucket is sharded over ("dp_shard"; "dp" = every
    data-parallel rank). ``fp8``: gather ``BlockShard`` 2-D parameters as blockwise FP8 (``block x
    block`` tiles). ``name``: for errors and the manifest (default: its index)."""

    patterns: list[str]
    placement: Placement
    mesh_dim: str = "dp_shard"
    fp8: bool = False
    name: str = ""

    def describe(self) -> str:
        p = self.placement
        text = {"shard": lambda: f"shard({p.dim})", "owned": lambda: "owned",
                "block_shard": lambda: f"block_shard({p.dim},{p.block})"}[p.name]()
        return text + ("+fp8" if self.fp8 else "") + ("" if self.mesh_dim == "dp_shard" else f"@{self.mesh_dim}")


def piece(length: int, world: int, rank: int, block: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s piece of ``length`` elements cut in whole ``block``s."""
    if length == 0:
        return 0, 0
    rows = block_shard_rows(length, world, rank, block)
    return rows.start, rows.stop - rows.start


@dataclasses.dataclass
class FlexParam:
    """Where this rank's local storage of one parameter sits in the whole parameter."""

    placement: str
    global_shape: tuple[int, ...]
    dim: int
    offset: int
    block: int | None
    owner: int | None
    group: Any
    rank: int
    world: int
    bucket: str
    fqn: str = ""

    def __getstate__(self) -> dict:
        """Pickled without the process group (a parameter pickles its attributes; a group cannot)."""
        return {**self.__dict__, "group": None}

    # ------------------------------------------------------------------ pieces

    def piece_of(self, rank: int) -> tuple[int, int]:
        """(offset, length along ``dim``) of ``rank``'s piece."""
        n = self.global_shape[self.dim]
        if self.placement == "owned":
            return (0, n) if rank == self.owner else (0, 0)
        return piece(n, self.world, rank, 1 if self.block is None else self.block)

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = self.piece_of(rank)[1]
        return tuple(shape)

    def piece_numel(self, rank: int) -> int:
        return math.prod(self.piece_shape(rank))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.piece_shape(self.rank)

    @property
    def is_whole(self) -> bool:
        """This rank's storage is the whole parameter (owned here, or a world of 1)."""
        return tuple(self.local_shape) == tuple(self.global_shape)

    def shard_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole tensor (a view; no communication)."""
        offset, length = self.piece_of(self.rank)
        return whole.narrow(self.dim, offset, length)

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece (shaped), in rank order."""
        if self.placement == "owned":
            return pieces[self.owner]
        real = [p for p in pieces if p.shape[self.dim] > 0]
        return real[0] if len(real) == 1 else torch.cat(real, dim=self.dim)

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor (``local``'s dtype) on every rank of ``group``: a collective (every rank
        calls it for the same parameters in the same order). ``local``: the parameter, its gradient
        or optimizer state of the same shape."""
        if self.is_whole and self.world == 1:
            return local.detach().clone()
        from lockstep.parallel.flex.collectives import all_gather_flat

        local = local.detach()
        slot = max(self.piece_numel(r) for r in range(self.world))
        send = local.new_zeros(slot)
        send[:local.numel()] = local.reshape(-1)
        out = all_gather_flat(send, self.world, self.group)
        pieces = [out[r * slot:r * slot + self.piece_numel(r)].view(self.piece_shape(r)) for r in range(self.world)]
        return self.assemble(pieces).clone()


def newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """Cost of orthogonalising a ``[..., m, n]`` parameter: ``batch * min(m,n)^2 * max(m,n)``; 1-D (or
    0-D) parameters cost their element count."""
    if len(shape) < 2:
        return math.prod(shape)
    m, n = shape[-2], shape[-1]
    return math.prod(shape[:-2]) * min(m, n) ** 2 * max(m, n)


def assign_owners(shapes: dict[str, tuple[int, ...]], world: int) -> dict[str, int]:
    """FQN -> owning rank: largest Newton-Schulz cost first, each to the least-loaded rank (ties: the
    lower rank), equal costs in FQN order -- the same answer on every rank, no communication."""
    load = [0] * world
    owners = {}
    for fqn in sorted(shapes, key=lambda f: (-newton_schulz_cost(shapes[f]), f)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[fqn] = rank
        load[rank] += newton_schulz_cost(shapes[fqn])
    return owners


def group_rank_world(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
