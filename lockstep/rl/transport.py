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

**Devices.** Every byte buffer lives on the device the group's backend carries
(:func:`transfer_device`): NCCL sends only CUDA tensors, gloo is meant for CPU tensors (it stages
CUDA ones through host memory itself). So a CUDA model on an NCCL sync group broadcasts from and
receives into CUDA buffers (pack/unpack are device copies, ordered on the current stream; NCCL's
``wait()`` orders that stream after the collective without blocking the host), and a CUDA model on
a gloo group packs into a CPU buffer. Objects (rollouts) travel as CPU bytes on a group that
carries CPU tensors, else through the accelerator's.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_ALIGN = 64  # bytes: every tensor's slice starts aligned for any dtype's view


def backend_devices(group: Any = None, config: str | None = None) -> dict[str, str]:
    """Device type -> backend name of ``group`` (``dist.get_backend_config``, e.g. ``"cpu:gloo,cuda:nccl"``;
    a bare ``"nccl"`` means CUDA, a bare ``"gloo"`` CPU and CUDA). ``config`` overrides the lookup (tests)."""
    config = dist.get_backend_config(group) if config is None else config
    out: dict[str, str] = {}
    for part in config.split(","):
        device, _, backend = part.strip().rpartition(":")
        if device:
            out[device] = backend
        elif backend == "nccl":
            out["cuda"] = backend
        else:
            out.update(cpu=backend, cuda=backend)
    return out


def transfer_device(group: Any, preferred: torch.device | str, config: str | None = None) -> torch.device:
    """The device whose tensors ``group`` should carry for data living on ``preferred``.

    ``preferred`` itself when the group's backend for it is native (CPU on any backend that takes
    CPU tensors; an accelerator on a non-gloo backend such as NCCL); else CPU when the group takes
    CPU tensors (gloo: a CUDA model stages through host memory); else the current device of the
    accelerator the group carries (an NCCL-only group and CPU data)."""
    preferred = torch.device(preferred)
    backends = backend_devices(group, config)
    if preferred.type in backends and (preferred.type == "cpu" or backends[preferred.type] != "gloo"):
        return preferred
    if "cpu" in backends:
        return torch.device("cpu")
    for device_type, backend in backends.items():
        if backend != "gloo":
            return torch.device(device_type, torch.get_device_module(device_type).current_device())
    raise ValueError(f"transport: process group backends {backends} carry neither CPU tensors nor an accelerator's")


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
    """One byte buffer laid out for a model's state; pack/unpack copy bit-exactly.

    Buffers live on the device ``group`` carries for the model's state (:func:`transfer_device`;
    no group: the model's device); pack/unpack copy across devices when the two differ."""

    def __init__(self, model: nn.Module, group: Any = None) -> None:
        self.entries: list[tuple[str, torch.Tensor, int, int]] = []  # name, tensor, offset, nbytes
        offset = 0
        for name, tensor in _unique_tensors(model):
            if not tensor.is_contiguous():
                raise ValueError(f"weight sync: {name} is not contiguous")
            nbytes = tensor.numel() * tensor.element_size()
            self.entries.append((name, tensor, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset
        #: where the model's state lives (the first tensor's device)
        self.model_device = self.entries[0][1].device if self.entries else torch.device("cpu")
        #: where buffers live
        self.device = self.model_device if group is None else transfer_device(group, self.model_device)

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
        self.flat = FlatState(model, group)
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
        self.flat = FlatState(model, group)
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
    device = transfer_device(group, "cpu")
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst=dst, group=group, tag=tag)
    dist.send(payload.to(device), dst=dst, group=group, tag=tag)


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
    """Receive an object :func:`send_object` sent."""
    device = transfer_device(group, "cpu")
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src, group=group, tag=tag)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=src, group=group, tag=tag)
    return pickle.loads(payload.cpu().numpy().tobytes())
