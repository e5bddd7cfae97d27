"""Resharding weight sync: each weights version goes from the trainer's layout to a generator group's
layout directly, trainer rank to generator rank, without gathering the model anywhere.

- :func:`describe` says where each tensor of a model's state lives: its global shape and dtype, the
  global ranks of its mesh and the placements on it (a DTensor's own; a plain tensor is whole on
  every rank of the side that holds it). Descriptions are small, picklable and exchanged once.
- :class:`ReshardPlan` is computed on every rank from the two descriptions alone (shapes +
  placements), so every rank gets the same plan: a list of :class:`Piece` (source rank, destination
  rank, tensor, the source's local slice, the destination's local slice). Each destination region
  is read from one source; where several source ranks hold it (replicas: HSDP, TP-replicated norms,
  a plain tensor on every trainer rank) the destinations are spread over them.
- :class:`ReshardSender` (every trainer rank) packs, per destination rank, its pieces into one byte
  buffer (a 64-byte header holding the version, then each piece 64-byte aligned) and sends it point
  to point; :class:`ReshardReceiver` (every generator rank) keeps the next two versions' receives
  posted (as :class:`~lockstep.rl.transport.WeightReceiver` does) and unpacks a version into its
  local shards when asked. Copies are bit-exact; a buffer whose header is not the expected version
  is an error.

gloo's point-to-point work cannot be polled (``is_completed`` turns true only in ``wait()``), so each
side's transfers run in a background thread of their own and the caller polls that thread; the
thread is the only user of the sync group. Placements understood: ``Shard(d)`` (torch's chunking:
``ceil(n / k)`` rows a rank, the last ones short or empty; several on one dim apply left to right,
DTensor's default order) and ``Replicate``; ``Partial`` and ``_StridedShard`` (FSDP over TP) are refused
by name.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lockstep.rl.transport import Watch, transfer_device

_ALIGN = 64
#: the point-to-point tag of resharded weights
RESHARD_TAG = 11

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
        local = _local(tensor)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
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


def _slices(bounds: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in bounds)


class _Packing:
    """The byte layout of one (src, dst) pair's buffer: a version header, then each piece aligned."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces = pieces
        self.offsets = []
        offset = _ALIGN
        for piece in pieces:
            self.offsets.append(offset)
            offset += -(-piece.nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset

    def views(self, buffer: torch.Tensor):
        for piece, offset in zip(self.pieces, self.offsets):
            yield piece, buffer[offset:offset + piece.nbytes].view(getattr(torch, piece.dtype)).view(piece.shape)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _local(t) for name, t in unique_state(model)}


class ReshardSender:
    """A source rank's end (every trainer rank): ``send()`` after each optimizer step.

    Buffers (one per destination rank) are reused: ``send`` first waits for the previous version's
    transfers (watched, when a ``watch`` is given: a lost generator raises PeerLost)."""

    def __init__(self, model: nn.Module, plan: ReshardPlan, rank: int, group: Any = None,
                 watch: Watch | None = None, watch_rank: int | None = None) -> None:
        self.tensors, self.rank, self.group = _tensors(model), rank, group
        self.watch, self.watch_rank = watch, watch_rank
        sends = plan.sends(rank)
        self.packings = {dst: _Packing(pieces) for dst, pieces in sends.items()}
        device = transfer_device(group, next(iter(self.tensors.values())).device)
        self.buffers = {dst: torch.empty(p.nbytes, dtype=torch.uint8, device=device)
                        for dst, p in self.packings.items()}
        self.bytes = plan.bytes_sent(rank)
        self._pool = _OneThread("lockstep-reshard-send")
        self.sent = 0

    @torch.no_grad()
    def send(self, version: int) -> dict[str, float]:
        """Send version ``version`` of this rank's pieces; returns seconds waiting for the previous one,
        packing and in all, and the bytes this rank sends."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        for dst, packing in self.packings.items():
            buffer = self.buffers[dst]
            buffer[:8].view(torch.int64).fill_(version)
            for piece, view in packing.views(buffer):
                view.copy_(self.tensors[piece.name][_slices(piece.src_slices)])
        packed = time.perf_counter() - started - waited
        self._pool.submit(self._transfer)
        self.sent += 1
        return {"weight_sync/wait_s": waited, "weight_sync/pack_s": packed,
                "weight_sync/s": time.perf_counter() - started, "weight_sync/bytes": float(self.bytes)}

    def _transfer(self) -> None:
        works = [dist.isend(self.buffers[dst], dst=dst, group=self.group, tag=RESHARD_TAG)
                 for dst in sorted(self.buffers)]
        for work in works:
            work.wait()

    def wait(self) -> None:
        """Wait until the last version has gone out (watched: PeerLost names ``watch_rank``, the
        destination group's head, which the liveness channel knows)."""
        if self.watch is None:
            self._pool.result()
            return
        self.watch.wait([self.watch_rank], self._pool.idle)
        try:
            self._pool.result()
        except Exception as err:  # noqa: BLE001 -- a dead peer's connection error becomes PeerLost
            self.watch.blame(self.watch_rank, err)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


class ReshardReceiver:
    """A destination rank's end (every generator rank): versions ``first .. last`` arrive in order.

    A background thread keeps two versions' receives posted, so a trainer never waits for a generator
    that is busy generating; :meth:`poll` / :meth:`wait_for` / :meth:`apply_until` unpack them."""

    def __init__(self, model: nn.Module, plan: ReshardPlan, rank: int, group: Any = None, *, first: int,
                 last: int) -> None:
        self.tensors, self.rank, self.group = _tensors(model), rank, group
        receives = plan.receives(rank)
        self.packings = {src: _Packing(pieces) for src, pieces in receives.items()}
        self.bytes = sum(p.nbytes for pieces in receives.values() for p in pieces)
        device = transfer_device(group, next(iter(self.tensors.values())).device)
        self.version, self.last = first - 1, last
        self.apply_s = 0.0
        #: called with each version once applied (a group's head tells its other ranks to apply it too)
        self.on_apply: Callable[[int], None] | None = None
        self._free: queue.Queue = queue.Queue()
        for _ in range(2):
            self._free.put({src: torch.empty(p.nbytes, dtype=torch.uint8, device=device)
                            for src, p in self.packings.items()})
        self._done: queue.Queue = queue.Queue()
        self._head: tuple[int, dict] | None = None
        self._thread = threading.Thread(target=self._receive_all, args=(first, last), daemon=True,
                                        name="lockstep-reshard-recv")
        self._thread.start()

    def _receive_all(self, first: int, last: int) -> None:
        for version in range(first, last + 1):
            buffers = self._free.get()
            try:
                works = [dist.irecv(buffers[src], src=src, group=self.group, tag=RESHARD_TAG)
                         for src in sorted(buffers)]
                for work in works:
                    work.wait()
            except BaseException as err:  # noqa: BLE001 -- handed to the applying thread
                self._done.put((version, err))
                return
            self._done.put((version, buffers))

    def _next(self, timeout: float | None) -> bool:
        if self._head is None:
            try:
                self._head = self._done.get(timeout=timeout) if timeout != 0 else self._done.get_nowait()
            except queue.Empty:
                return False
        return True

    @torch.no_grad()
    def _apply_next(self) -> None:
        version, buffers = self._head
        self._head = None
        if isinstance(buffers, BaseException):
            raise buffers
        started = time.perf_counter()
        for src, packing in self.packings.items():
            got = int(buffers[src][:8].view(torch.int64).item())
            if got != version:
                raise RuntimeError(f"weight sync: rank {self.rank} expected version {version} from rank {src}, "
                                   f"got {got}")
            for piece, view in packing.views(buffers[src]):
                self.tensors[piece.name][_slices(piece.dst_slices)].copy_(view)
        self.apply_s += time.perf_counter() - started
        self.version = version
        self._free.put(buffers)
        if self.on_apply is not None:
            self.on_apply(version)

    def poll(self) -> int:
        """Apply every version that has fully arrived (without waiting); returns the version held."""
        while self.version < self.last and self._next(0):
            self._apply_next()
        return self.version

    def apply_until(self, version: int, interrupt: Any = None) -> float | None:
        """Block until exactly ``version`` is applied (no newer one: a group's ranks must hold the same
        version); returns seconds waited, or None when ``interrupt()`` turned true first."""
        if version > self.last:
            raise ValueError(f"weight sync: version {version} will never be sent (last is {self.last})")
        started = time.perf_counter()
        while self.version < version:
            if self._next(0.001 if interrupt is not None else None):
                self._apply_next()
            elif interrupt():
                return None
        return time.perf_counter() - started

    def wait_for(self, version: int, interrupt: Any = None) -> float | None:
        """Block until ``version`` (or newer) is applied, then take any newer complete one (as
        :meth:`~lockstep.rl.transport.WeightReceiver.wait_for`)."""
        waited = self.apply_until(version, interrupt)
        if waited is not None:
            self.poll()
        return waited

    def drain(self) -> None:
        """Receive (and apply) every remaining version: the trainer's sends need every receiver."""
        while self.version < self.last:
            self._next(None)
            self._apply_next()


class _OneThread:
    """Runs one job at a time in a thread of its own; ``idle()`` polls it, ``result()`` waits and re-raises."""

    def __init__(self, name: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._future = None

    def submit(self, fn) -> None:
        self._future = self._pool.submit(fn)

    def idle(self) -> bool:
        return self._future is None or self._future.done()

    def result(self) -> None:
        if self._future is not None:
            future, self._future = self._future, None
            future.result()

    def shutdown(self) -> None:
        self._pool.shutdown()


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


__all__ = ["RESHARD_TAG", "Piece", "ReshardPlan", "ReshardReceiver", "ReshardSender", "TensorLayout", "describe",
           "exchange_layouts", "side_layout", "unique_state"]
