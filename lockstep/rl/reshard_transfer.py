"""Resharding weight sync, the transfers: each version of a :class:`~lockstep.rl.reshard.ReshardPlan`'s
pieces, trainer rank to generator rank, point to point.

:class:`ReshardSender` (every trainer rank) packs, per destination rank, its pieces into one byte
buffer (a 64-byte header holding the version, then each piece 64-byte aligned) and sends it;
:class:`ReshardReceiver` (every generator rank) keeps the next two versions' receives posted (as
:class:`~lockstep.rl.transport.WeightReceiver` does) and unpacks a version into its local shards when
asked. Copies are bit-exact; a buffer whose header is not the expected version is an error.

gloo's point-to-point work cannot be polled (``is_completed`` turns true only in ``wait()``), so each
side's transfers run in a background thread of their own and the caller polls that thread; the
thread is the only user of the sync group. Buffers live on the device the group carries
(:func:`~lockstep.rl.transport.transfer_device`).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lockstep.rl.reshard import Piece, ReshardPlan, local_tensor, unique_state
from lockstep.rl.transport import Watch, transfer_device

_ALIGN = 64
#: the point-to-point tag of resharded weights
RESHARD_TAG = 11


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
    return {name: local_tensor(t) for name, t in unique_state(model)}


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


__all__ = ["RESHARD_TAG", "ReshardReceiver", "ReshardSender"]
