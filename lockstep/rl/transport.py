"""Moving weights and rollouts between the trainer and generator processes over ``torch.distributed``.

- :class:`FlatState` packs every tensor a model's ``state_dict`` holds (parameters and buffers, tied
  ones once) into one byte buffer and back, so a weight sync is **one** broadcast whatever the
  dtypes, and the copy is bit-exact.
- :class:`WeightSender` (the trainer) broadcasts version after version from rank 0 of the sync
  group without waiting for the generators (``async_op``); it waits only before reusing its buffer.
- :class:`WeightReceiver` (a generator) keeps receives posted into two staging buffers, so the
  trainer never waits for a generator that is busy generating; :meth:`WeightReceiver.poll` applies
  the newest complete version between batches, :meth:`WeightReceiver.wait_for` blocks until a
  version has arrived. Versions arrive in order: the k-th broadcast is version ``first + k``.
- :func:`send_object` / :func:`recv_object`: a picklable object as a size tensor plus a byte tensor,
  point to point; :class:`ObjectSender` sends from a background thread so the generator can go on.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_ALIGN = 64  # bytes: every tensor's slice starts aligned for any dtype's view


def _unique_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the state dict, sorted by name, each storage once (tied weights)."""
    seen, out = set(), []
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


class FlatState:
    """One byte buffer laid out for a model's state; pack/unpack copy bit-exactly."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: list[tuple[str, torch.Tensor, int, int]] = []  # name, tensor, offset, nbytes
        offset = 0
        for name, tensor in _unique_tensors(model):
            if not tensor.is_contiguous():
                raise ValueError(f"weight sync: {name} is not contiguous")
            nbytes = tensor.numel() * tensor.element_size()
            self.entries.append((name, tensor, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset
        self.device = self.entries[0][1].device if self.entries else torch.device("cpu")

    def new_buffer(self) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def _views(self, buffer: torch.Tensor):
        for name, tensor, offset, nbytes in self.entries:
            view = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
            yield name, tensor, view

    @torch.no_grad()
    def pack(self, buffer: torch.Tensor) -> None:
        for _, tensor, view in self._views(buffer):
            view.copy_(tensor.detach())

    @torch.no_grad()
    def unpack(self, buffer: torch.Tensor) -> None:
        for _, tensor, view in self._views(buffer):
            tensor.detach().copy_(view)


class WeightSender:
    """The trainer's end: ``send()`` after each optimizer step (rank ``src`` of ``group``)."""

    def __init__(self, model: nn.Module, group: Any, src: int = 0) -> None:
        self.flat = FlatState(model)
        self.buffer = self.flat.new_buffer()
        self.group, self.src = group, src
        self._work = None
        self.sent = 0

    def send(self) -> dict[str, float]:
        """Broadcast the current weights; returns seconds waiting for the previous send and packing."""
        started = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        waited = time.perf_counter() - started
        self.flat.pack(self.buffer)
        self._work = dist.broadcast(self.buffer, src=self.src, group=self.group, async_op=True)
        self.sent += 1
        return {"weight_sync/wait_s": waited, "weight_sync/s": time.perf_counter() - started,
                "weight_sync/bytes": float(self.flat.nbytes)}

    def close(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class WeightReceiver:
    """A generator's end: versions ``first .. last`` arrive in order into two staging buffers."""

    def __init__(self, model: nn.Module, group: Any, *, first: int, last: int, src: int = 0) -> None:
        self.flat = FlatState(model)
        self.group, self.src = group, src
        self.version = first - 1  # nothing applied yet
        self.last = last
        self._next_post = first
        self._free = [self.flat.new_buffer(), self.flat.new_buffer()]
        self._pending: list[tuple[int, torch.Tensor, Any]] = []  # (version, buffer, work) in order
        self.apply_s = 0.0
        self._post()

    def _post(self) -> None:
        while self._free and self._next_post <= self.last:
            buffer = self._free.pop()
            work = dist.broadcast(buffer, src=self.src, group=self.group, async_op=True)
            self._pending.append((self._next_post, buffer, work))
            self._next_post += 1

    def _apply_first(self) -> None:
        version, buffer, work = self._pending.pop(0)
        work.wait()
        started = time.perf_counter()
        self.flat.unpack(buffer)
        self.apply_s += time.perf_counter() - started
        self.version = version
        self._free.append(buffer)
        self._post()

    def poll(self) -> int:
        """Apply every version that has fully arrived (without waiting); returns the version held."""
        while self._pending and self._pending[0][2].is_completed():
            self._apply_first()
        return self.version

    def wait_for(self, version: int) -> float:
        """Block until ``version`` (or newer) is applied; returns seconds waited. Then takes any
        newer version already complete."""
        if version > self.last:
            raise ValueError(f"weight sync: version {version} will never be sent (last is {self.last})")
        started = time.perf_counter()
        while self.version < version:
            self._apply_first()
        self.poll()
        return time.perf_counter() - started

    def drain(self) -> None:
        """Receive (and apply) every remaining version: the trainer's broadcasts need every receiver."""
        while self._pending:
            self._apply_first()


def send_object(obj: Any, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send a picklable object (blocking until the receiver has it)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst, group=group, tag=tag)
    dist.send(payload, dst=dst, group=group, tag=tag)


class ObjectSender:
    """Sends objects from a background thread, one at a time, so the caller can keep working (and
    keep polling weights) while the receiver is busy. gloo's ``isend`` cannot be polled: its work
    reports completion only from ``wait()``."""

    def __init__(self, dst: int, group: Any = None, tag: int = 0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.dst, self.group, self.tag = dst, group, tag
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-send")
        self._future = None

    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()  # re-raises a failed send
            self._future = None

    def send(self, obj: Any) -> None:
        """Start sending ``obj`` once the previous object is delivered (waits for that one)."""
        self.wait()
        self._future = self._pool.submit(send_object, obj, self.dst, self.group, self.tag)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


def recv_object(src: int, group: Any = None, tag: int = 0) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group, tag=tag)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group, tag=tag)
    return pickle.loads(payload.numpy().tobytes())
