"""Moving weights and rollouts between the trainer and generator processes over ``torch.distributed``.

- :class:`FlatState` packs every tensor a model's ``state_dict`` holds (parameters and buffers, tied
  ones once) into one byte buffer and back, so a weight sync is **one** broadcast whatever the
  dtypes, and the copy is bit-exact.
- :class:`WeightSender` (the trainer) broadcasts version after version from rank 0 to each generator
  over that generator's own two-rank group, without waiting for them (``async_op``); it waits only
  before reusing its buffer.
- :class:`WeightReceiver` (a generator) keeps receives posted into two staging buffers, so the
  trainer never waits for a generator that is busy generating; :meth:`WeightReceiver.poll` applies
  the newest complete version between batches, :meth:`WeightReceiver.wait_for` blocks until a
  version has arrived. Versions arrive in order: the k-th broadcast is version ``first + k``.
- :func:`send_object` / :func:`recv_object`: a picklable object as a size tensor plus a byte tensor,
  point to point; :class:`ObjectSender` sends from a background thread so the generator can go on;
  :class:`RolloutInbox` receives each step's rollouts on the trainer.

**Watched waits.** Given a ``watch`` (the trainer's :class:`~lockstep.rl.liveness.TrainerLiveness`),
the trainer's waits on a generator poll instead of blocking, and raise
:class:`~lockstep.rl.liveness.PeerLost` as soon as that generator is lost (a blocked gloo transfer
would wait for the process group's timeout, 30 min); the wait that never finishes is abandoned.

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
import threading
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

_ALIGN = 64  # bytes: every tensor's slice starts aligned for any dtype's view
#: the point-to-point tag of rollouts (generator -> trainer rank 0)
ROLLOUT_TAG = 7


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


class Watch(Protocol):
    """What watches the trainer's waits on generators (:class:`~lockstep.rl.liveness.TrainerLiveness`)."""

    def wait(self, ranks: list[int], done: Any, poll_s: float = ...) -> None: ...

    def blame(self, rank: int, error: BaseException) -> None: ...


def wait_work(work: Any, rank: int, watch: Watch | None = None) -> None:
    """Wait for an async transfer with ``rank``: blocking without a watch, else polled and watched."""
    if watch is None:
        work.wait()
        return
    watch.wait([rank], work.is_completed)
    try:
        work.wait()  # completed: returns at once, or raises the transfer's error
    except Exception as err:  # noqa: BLE001 -- a dead peer's connection error becomes PeerLost
        watch.blame(rank, err)


class WeightSender:
    """The trainer's end: ``send()`` after each optimizer step, from rank ``src`` to every generator over
    its own group (``groups``: generator rank -> group; one buffer, one broadcast per generator)."""

    def __init__(self, model: nn.Module, groups: dict[int, Any], src: int = 0, watch: Watch | None = None) -> None:
        self.groups = dict(groups)
        self.flat = FlatState(model, next(iter(self.groups.values())))
        self.buffer = self.flat.new_buffer()
        self.src, self.watch = src, watch
        self._works: dict[int, Any] = {}
        self.sent = 0

    def send(self, version: int | None = None) -> dict[str, float]:
        """Broadcast the current weights (``version``: implied by the order, unused); returns seconds waiting
        for the previous send and packing.
        Raises PeerLost (nothing sent) when a generator is lost while waiting: ``drop`` it, call again."""
        started = time.perf_counter()
        self._wait_all()
        waited = time.perf_counter() - started
        self.flat.pack(self.buffer)
        for rank, group in self.groups.items():
            self._works[rank] = dist.broadcast(self.buffer, src=self.src, group=group, async_op=True)
        self.sent += 1
        return {"weight_sync/wait_s": waited, "weight_sync/s": time.perf_counter() - started,
                "weight_sync/bytes": float(self.flat.nbytes)}

    def _wait_all(self) -> None:
        for rank, work in list(self._works.items()):
            wait_work(work, rank, self.watch)
            del self._works[rank]

    def drop(self, rank: int) -> None:
        """Send nothing more to generator ``rank`` (lost); its pending broadcast is abandoned."""
        self.groups.pop(rank, None)
        self._works.pop(rank, None)

    def close(self) -> None:
        self._wait_all()


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

    def wait_for(self, version: int, interrupt: Any = None) -> float | None:
        """Block until ``version`` (or newer) is applied; returns seconds waited. Then takes any
        newer version already complete. ``interrupt``: a callable polled while waiting; when it turns
        true the wait ends early and returns None (versions complete by then are applied)."""
        if version > self.last:
            raise ValueError(f"weight sync: version {version} will never be sent (last is {self.last})")
        started = time.perf_counter()
        while self.version < version:
            if interrupt is None or self._pending[0][2].is_completed():
                self._apply_first()
            elif interrupt():
                return None
            else:
                time.sleep(0.001)
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


class _Receive:
    """One :func:`recv_object` in a thread of its own (it may never finish: its sender was lost)."""

    def __init__(self, src: int, group: Any, tag: int) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(src, group, tag), daemon=True, name="lockstep-recv").start()

    def _run(self, src: int, group: Any, tag: int) -> None:
        try:
            self.value = recv_object(src, group, tag)
        except BaseException as err:  # noqa: BLE001 -- handed to the waiting thread
            self.error = err
        self.done.set()


class RolloutInbox:
    """Trainer rank 0's end of the rollouts: :meth:`receive` returns step ``step``'s payload (a dict with
    ``"step"``), taking payloads from ``src`` until it comes. Others are kept for their step (a generator
    that took over a lost one's batches may deliver them out of order); ones for steps already taken are
    dropped (a batch produced twice). With a ``watch``, each receive runs in a thread of its own and the
    wait is watched (PeerLost; ``drop`` abandons it)."""

    def __init__(self, group: Any, tag: int, watch: Watch | None = None) -> None:
        self.group, self.tag, self.watch = group, tag, watch
        self._stash: dict[int, dict] = {}
        self._pending: dict[int, _Receive] = {}

    def receive(self, step: int, src: int) -> dict:
        while step not in self._stash:
            payload = self._next_from(src)
            if payload["step"] >= step:
                self._stash.setdefault(payload["step"], payload)
        for old in [s for s in self._stash if s < step]:
            del self._stash[old]
        return self._stash.pop(step)

    def _next_from(self, src: int) -> dict:
        if self.watch is None:
            return recv_object(src, group=self.group, tag=self.tag)
        pending = self._pending.get(src) or self._pending.setdefault(src, _Receive(src, self.group, self.tag))
        self.watch.wait([src], lambda: pending.done.wait(0.02), poll_s=0.0)
        del self._pending[src]
        if pending.error is not None:
            self.watch.blame(src, pending.error)
        return pending.value

    def drop(self, src: int) -> None:
        """Receive nothing more from ``src`` (lost): its pending receive is abandoned."""
        self._pending.pop(src, None)
