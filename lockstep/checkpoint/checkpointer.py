"""The trainer's side of checkpointing: stage, hand off, wait; and load (with resharding).

``save(step, slots, rank_state)`` blocks only to copy the state into a pre-allocated staging
buffer (shared memory, reused by every save), then hands a small job to the background writer
process; a save first waits for the previous one (at most one in flight, since they share the
buffer). ``poll``/``wait`` report finished saves with their timings. ``load`` reads the newest
complete checkpoint into any layout's tensors.

Tensors on an accelerator (CUDA) are staged with non-blocking device-to-host copies into the
buffer, which is page-locked for them (``cudaHostRegister``, once, on the first such save), and
their devices are synchronised once before the job is handed off: the writer never reads a
half-copied buffer. CPU tensors are copied exactly as before. Loads copy each saved chunk into the
slot's tensor on whatever device it lives.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import time
import warnings
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from lockstep.checkpoint.dtypes import DTYPE_NAMES, SAFETENSORS_CODES
from lockstep.checkpoint.format import INDEX, LATEST, CheckpointError, parse_step_dir, plan_shards, step_dir
from lockstep.checkpoint.layout import Slot, owned_chunks
from lockstep.checkpoint.shm import create_segment, remove_stale_segments
from lockstep.checkpoint.storage import LocalStorage, Storage
from lockstep.checkpoint.writer import (
    SaveJob, WritePlan, complete_steps, recover_leftovers, run_job, set_aside, writer_main,
)


@dataclasses.dataclass
class SaveStats:
    """One save, as reported to metrics: ``blocking_ms`` is what the trainer waited for."""

    step: int
    blocking_ms: float
    #: part of blocking_ms spent waiting for the previous save's write (at most one in flight)
    waited_ms: float = 0.0
    write_s: float = 0.0
    bytes: int = 0
    error: str | None = None

    def record(self) -> dict:
        out = {"checkpoint/step": self.step, "checkpoint/blocking_ms": self.blocking_ms,
               "checkpoint/waited_ms": self.waited_ms,
               "checkpoint/write_s": self.write_s, "checkpoint/bytes": self.bytes,
               "checkpoint/mb_per_s": self.bytes / 1e6 / self.write_s if self.write_s else 0.0}
        if self.error:
            out["checkpoint/error"] = self.error
        return out


class Checkpointer:
    """Saves and loads sharded checkpoints in ``storage``; one per rank, created on every rank."""

    def __init__(self, storage: Storage, *, rank: int = 0, world_size: int = 1, keep: int = 3,
                 mode: str = "process", max_file_bytes: int = 1 << 30, commit_timeout_s: float = 600.0,
                 group=None) -> None:
        if mode not in ("process", "sync"):
            raise ValueError(f"checkpoint.mode: must be 'process' or 'sync', got {mode!r}")
        self.storage, self.rank, self.world_size = storage, rank, world_size
        #: the process group of the ranks that save together (None: the default group); an RL job's
        #: trainer ranks are a subset of its world
        self.group = group
        self.keep, self.mode, self.max_file_bytes, self.commit_timeout_s = keep, mode, max_file_bytes, commit_timeout_s
        self._plan: WritePlan | None = None
        self._plan_key: tuple | None = None
        self._buffer: torch.Tensor | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._views: dict[str, torch.Tensor] = {}
        #: the staging buffer is page-locked for device-to-host copies (see the module docstring);
        #: tried once per buffer
        self._pinned = self._pin_tried = False
        self._in_flight: SaveStats | None = None
        self._done: list[SaveStats] = []
        self._proc = None
        if rank == 0:
            removed, moved = reading(storage, "tidying interrupted saves", lambda: recover_leftovers(storage))
            if removed:
                warnings.warn(f"checkpoint: removed incomplete saves {removed} from {storage.describe()} "
                              "(staging directories that never got an index)", stacklevel=2)
            for line in moved:
                warnings.warn(f"checkpoint: moved aside, kept, not loaded: {line}", stacklevel=2)
        if mode == "process":
            stale = remove_stale_segments()
            if stale:
                warnings.warn(f"checkpoint: freed {len(stale)} staging buffer(s) a killed run left in /dev/shm: "
                              f"{stale}", stacklevel=2)
            self._start_writer()  # spawning takes a second or two: start before the first save

    # -- saving -------------------------------------------------------------------------------

    def prepare(self, slots: dict[str, Slot]) -> None:
        """Plan the layout and fault in the staging buffer now (every rank, together), so the
        first ``save`` costs what every later one does. Optional: ``save`` plans on first use."""
        self._ensure_plan(slots)
        if self._buffer is not None:
            self._buffer.zero_()  # first touch of shared memory pages is several times a copy's cost

    def save(self, step: int, slots: dict[str, Slot], rank_state: dict, metadata: dict | None = None) -> SaveStats:
        """Stage ``slots`` and start writing checkpoint ``step``; every rank calls it at the same step."""
        started = time.perf_counter()
        self._wait_in_flight()
        waited_ms = (time.perf_counter() - started) * 1e3
        self._ensure_plan(slots)
        if not self._pin_tried and any(s.tensor.device.type == "cuda" for s in slots.values()):
            self._pin_buffer()
        stage(self._views, slots)
        job = SaveJob(step, rank_state, metadata or {})
        if self.mode == "sync":
            result = run_job(self.storage, self._plan, job, self._memoryview())
            stats = SaveStats(step, (time.perf_counter() - started) * 1e3, waited_ms, result["write_s"],
                              result["bytes"])
            self._done.append(stats)
            return stats
        self._ensure_writer_alive()
        self._jobs.put(("save", job))
        self._in_flight = SaveStats(step, (time.perf_counter() - started) * 1e3, waited_ms)
        return self._in_flight

    def poll(self) -> list[SaveStats]:
        """Saves finished since the last call (non-blocking)."""
        self._collect(block=False)
        done, self._done = self._done, []
        return done

    def wait(self) -> list[SaveStats]:
        """Block until the in-flight save (if any) is written; returns finished saves."""
        self._wait_in_flight()
        return self.poll()

    def close(self, abandon: bool = False) -> list[SaveStats]:
        """Finish the in-flight save (or, with ``abandon``, kill it: it stays invisible) and stop the writer."""
        if self._proc is None:
            return self.poll()
        if abandon:
            self._proc.kill()
            self._in_flight = None
        else:
            self._wait_in_flight()
            self._jobs.put(("stop",))
        self._proc.join(timeout=30)
        self._proc = None
        self._release_buffer()
        return self.poll()

    def _wait_in_flight(self) -> None:
        while self._in_flight is not None:
            self._collect(block=True)

    def _collect(self, block: bool) -> None:
        if self._in_flight is None:
            return
        try:
            kind, payload = self._results.get(timeout=0.1 if block else 0)
        except queue.Empty:
            if self._proc is not None and not self._proc.is_alive():
                stats, self._in_flight = self._in_flight, None
                stats.error = (f"the checkpoint writer process died (exit code {self._proc.exitcode}) while writing "
                               f"step {stats.step}; that checkpoint is not visible, earlier ones are intact")
                warnings.warn("checkpoint: " + stats.error, stacklevel=3)
                self._done.append(stats)
                self._start_writer()
            return
        stats, self._in_flight = self._in_flight, None
        if kind == "done":
            stats.write_s, stats.bytes = payload["write_s"], payload["bytes"]
        else:
            stats.error = payload["error"]
            warnings.warn(f"checkpoint: saving step {stats.step} failed: {payload['error']}", stacklevel=3)
        self._done.append(stats)

    def _start_writer(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe beside OpenMP/gloo threads
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=writer_main, args=(self.storage, self._jobs, self._results, os.getpid()),
                                 daemon=True, name=f"lockstep-ckpt-writer-{self.rank}")
        self._proc.start()
        if self._plan is not None:
            self._jobs.put(("plan", self._plan, self._shm.name if self._shm is not None else ""))

    def _ensure_writer_alive(self) -> None:
        if not self._proc.is_alive():
            self._start_writer()

    @property
    def writer_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _memoryview(self) -> memoryview:
        return memoryview(self._buffer.numpy()).cast("B") if self._buffer.numel() else memoryview(b"")

    def _ensure_plan(self, slots: dict[str, Slot]) -> None:
        key = tuple(sorted((n, s.signature()) for n, s in slots.items()))
        if key == self._plan_key:
            return
        mine = {n: s.signature() for n, s in slots.items()}
        tables = [mine]
        if self.world_size > 1:  # one collective, on the first save only
            tables = [None] * self.world_size
            dist.all_gather_object(tables, mine, group=self.group)
        files_of = {}
        for r in (range(self.world_size) if self.rank == 0 else [self.rank]):
            owned = [(n, SAFETENSORS_CODES[tables[r][n][3]], tables[r][n][3].itemsize, tables[r][n][2])
                     for n in owned_chunks(tables, r)]
            files_of[r], size = plan_shards(owned, f"rank-{r:05d}", self.max_file_bytes)
            if r == self.rank:
                my_size = size
        tensors = _index_table(tables, files_of) if self.rank == 0 else None
        self._plan = WritePlan(self.rank, self.world_size, files_of[self.rank], tensors, self.keep,
                               self.commit_timeout_s)
        self._release_buffer()
        if self.mode == "process" and my_size:
            self._shm = create_segment(my_size)
            self._buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=my_size)
        else:
            self._buffer = torch.empty(my_size, dtype=torch.uint8)
        self._views = {}
        for shard in self._plan.files:
            for e in shard.entries:
                dtype = _DTYPE_OF_CODE[e.dtype]
                self._views[e.key] = self._buffer[e.begin:e.begin + e.nbytes].view(dtype).view(e.shape)
        self._plan_key = key
        if self.mode == "process":
            self._jobs.put(("plan", self._plan, self._shm.name if self._shm is not None else ""))

    def _pin_buffer(self) -> None:
        """Page-lock the staging buffer so CUDA copies into it run asynchronously (as torch's own
        async checkpoint stager does); without it they still work, one synchronous copy at a time."""
        self._pin_tried = True
        if self._buffer is None or not self._buffer.numel():
            return
        error = int(torch.cuda.cudart().cudaHostRegister(self._buffer.data_ptr(), self._buffer.numel(), 1))
        self._pinned = error == 0
        if error:
            warnings.warn(f"checkpoint: page-locking the {self._buffer.numel()}-byte staging buffer failed "
                          f"(cudaError {error}); device-to-host staging copies run synchronously", stacklevel=3)

    def _release_buffer(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._pinned = self._pin_tried = False
        self._views, self._buffer = {}, None
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:  # a view still exported; the unlink below still frees it at exit
                pass
            self._shm.unlink()
            self._shm = None

    # -- loading ------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        return reading(self.storage, "listing checkpoints", lambda: latest_step(self.storage))

    def complete_steps(self) -> list[int]:
        """Published checkpoints (with an index; not yet verified), oldest first."""
        return reading(self.storage, "listing checkpoints", lambda: complete_steps(self.storage))

    def access_problem(self, step: int) -> str | None:
        """Why checkpoint ``step``'s files cannot be opened for reading (permissions, I/O), or None. Asked
        after a failed load, to tell an access problem (every checkpoint is as unreadable: no reason to
        fall back) from damage, whatever error type the reader wrapped it in. Local storage only."""
        if not isinstance(self.storage, LocalStorage):
            return None
        folder = self.storage.root / step_dir(step)
        try:
            for path in sorted(folder.iterdir()):
                with open(path, "rb"):
                    pass
        except FileNotFoundError:
            return None
        except OSError as err:
            reason = f"{err.strerror} (errno {err.errno})" if err.strerror else str(err)
            return (f"{err.filename or folder}: loading checkpoint step {step} in {self.storage.describe()} "
                    f"failed: {reason}")
        return None

    def set_aside(self, step: int, reason: str) -> str:
        """Rank 0: move checkpoint ``step`` out of the way (kept; no longer loaded, counted or pruned)."""
        return reading(self.storage, f"moving checkpoint step {step} aside",
                       lambda: set_aside(self.storage, step_dir(step), reason))

    def load(self, slots: dict[str, Slot], step: int | None = None) -> tuple[int, dict, dict]:
        """Fill ``slots`` from checkpoint ``step`` (default: the latest complete one); returns
        (step, this rank's saved state (rank 0's when the saving run had fewer ranks), metadata).

        In a distributed run every rank must call it: the names the whole job holds are gathered
        so a pipeline stage is not told the other stages' tensors are "unexpected"."""
        job_names = None
        if self.world_size > 1:
            import torch.distributed as dist

            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(slots), group=self.group)
            job_names = set().union(*gathered)
        return reading(self.storage, f"loading checkpoint step {step}",
                       lambda: load_into(self.storage, slots, step, self.rank, job_names))


_DTYPE_OF_CODE = {code: dt for dt, code in SAFETENSORS_CODES.items()}


def stage(views: dict[str, torch.Tensor], slots: dict[str, Slot]) -> None:
    """Copy each slot's tensor into its staging view. CPU tensors copy as they always have; tensors on
    an accelerator are queued as non-blocking copies and each such device synchronised once at the
    end, so the buffer is complete when this returns."""
    devices = set()
    with torch.no_grad():
        for name, view in views.items():
            tensor = slots[name].tensor.detach()
            if tensor.device.type == "cpu":
                view.copy_(tensor.reshape(view.shape))
            else:
                view.copy_(tensor.reshape(view.shape), non_blocking=True)
                devices.add(tensor.device)
    for device in devices:
        torch.get_device_module(device.type).synchronize(device)


def _index_table(tables: list[dict], files_of: dict[int, list]) -> dict[str, dict]:
    file_of = {(r, e.key): shard.name for r, shards in files_of.items() for shard in shards for e in shard.entries}
    out: dict[str, dict] = {}
    for r, table in enumerate(tables):
        for name, (global_shape, offsets, shape, dtype) in table.items():
            if (r, name) not in file_of:
                continue
            entry = out.setdefault(name, {"dtype": DTYPE_NAMES[dtype], "shape": list(global_shape), "chunks": []})
            entry["chunks"].append({"file": file_of[(r, name)], "offsets": list(offsets), "shape": list(shape)})
    return out


class CheckpointAccessError(CheckpointError):
    """The storage could not be read or written (permissions, I/O): not a damaged checkpoint, so no
    reason to fall back to an older one (they are as unreadable)."""


def reading(storage: Storage, what: str, fn):
    """``fn()``, with an OS error (an unreadable directory or file) turned into a one-line
    CheckpointAccessError naming the path and ``what`` was being done. A missing file is damage, not
    access: a plain CheckpointError."""
    try:
        return fn()
    except FileNotFoundError as err:
        raise CheckpointError(f"{storage.describe()}: {what}: a file is missing: {err}") from None
    except OSError as err:
        reason = f"{err.strerror} (errno {err.errno})" if err.strerror else str(err)
        where = err.filename if err.filename else storage.describe()
        raise CheckpointAccessError(f"{where}: {what} in {storage.describe()} failed: {reason}") from None


def latest_step(storage: Storage) -> int | None:
    """The step the ``latest`` marker names if that checkpoint is complete, else the newest complete one."""
    marked = storage.get(LATEST).decode().strip() if storage.exists(LATEST) else ""
    step = parse_step_dir(marked)
    steps = complete_steps(storage)
    if step is not None and storage.exists(f"{marked}/{INDEX}"):
        return max([*steps, step])  # a newer complete step than the marker's wins
    return steps[-1] if steps else None


def load_into(storage: Storage, slots: dict[str, Slot], step: int | None, rank: int,
              job_names: set[str] | None = None) -> tuple[int, dict, dict]:
    from lockstep.checkpoint.reader import read_checkpoint

    if step is None:
        step = latest_step(storage)
        if step is None:
            raise CheckpointError(f"{storage.describe()}: no complete checkpoint to load")
    return (step, *read_checkpoint(storage, step, slots, rank, job_names))
