"""Serialising a staged checkpoint to storage, in a background process or inline.

``write_rank_part`` writes one rank's shards (header + bytes straight from the shared staging
buffer, sha256 computed on the way) and then its ``rank-NNNNN.json``. Rank 0 then ``commit``s:
it waits for every rank's JSON, writes ``index.json``, publishes the directory, advances the
``latest`` marker and prunes old checkpoints. A crash at any point before the publish leaves only
a staging directory, which readers never look at and the next run deletes.

``writer_main`` is the background process: it attaches to the staging buffer once (POSIX shared
memory, by name) and then receives small save jobs; it finishes a job even if the trainer dies
(the mapping stays valid), and exits when the trainer is gone and nothing is left to write. It
imports no torch, so it starts in a fraction of a second and costs little memory per rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import time
import traceback
import uuid
from multiprocessing import shared_memory

from lockstep.checkpoint.background import lower_priority
from lockstep.checkpoint.format import (
    FORMAT, INDEX, LATEST, VERSION, CheckpointError, ShardFile, digest, file_chunks, parse_step_dir,
    rank_state_file, step_dir,
)
from lockstep.checkpoint.storage import LocalStorage

#: the folder (under the storage root) holding what start-up or a resume moved out of the way
ASIDE = "set-aside"


@dataclasses.dataclass
class WritePlan:
    """What a rank writes for every save with this layout (fixed until shapes change)."""

    rank: int
    world_size: int
    files: list[ShardFile]
    #: rank 0 only: every tensor's dtype, global shape and chunks, for the index
    tensors: dict[str, dict] | None
    keep: int
    commit_timeout_s: float


@dataclasses.dataclass
class SaveJob:
    step: int
    rank_state: dict  # JSON-ready: RNG states, data loader, ...
    metadata: dict  # JSON-ready, rank 0: family, config, ...


def write_rank_part(storage, plan: WritePlan, job: SaveJob, buffer: memoryview) -> int:
    """Write this rank's shards and state file under the staging prefix; returns bytes written."""
    staging = storage.staging_prefix(step_dir(job.step))
    files: dict[str, dict] = {}
    for shard in plan.files:
        chunks = file_chunks(shard, buffer)
        sha, size = digest(chunks)
        put(storage, f"{staging}/{shard.name}", chunks)
        files[shard.name] = {"sha256": sha, "bytes": size}
    state = json.dumps({"rank": plan.rank, "step": job.step, "files": files, "state": job.rank_state}).encode()
    put(storage, f"{staging}/{rank_state_file(plan.rank)}", [state])
    return sum(f["bytes"] for f in files.values()) + len(state)


def put(storage, key: str, chunks: list) -> None:
    """``storage.put``, with an OS error (a full disk, a read-only or unwritable directory) turned into
    a one-line CheckpointError naming the file and the operation."""
    try:
        storage.put(key, chunks)
    except OSError as err:
        raise CheckpointError(f"{storage.describe()}/{key}: writing the checkpoint file failed: "
                              f"{_os_reason(err)}") from None


def _os_reason(err: OSError) -> str:
    return f"{err.strerror} (errno {err.errno})" if err.strerror else str(err)


def commit(storage, plan: WritePlan, job: SaveJob, parent_alive=lambda: True) -> None:
    """Rank 0: once every rank's part is there, write the index and make the checkpoint visible."""
    staging, final = storage.staging_prefix(step_dir(job.step)), step_dir(job.step)
    deadline = time.monotonic() + plan.commit_timeout_s
    pending = set(range(plan.world_size))
    files: dict[str, dict] = {}
    while pending:
        for r in sorted(pending):
            key = f"{staging}/{rank_state_file(r)}"
            if storage.exists(key):
                data = storage.get(key)
                part = json.loads(data)
                if part.get("step") != job.step:
                    continue  # a stale file from an earlier attempt at this step
                files.update(part["files"])
                sha, size = digest([data])
                files[rank_state_file(r)] = {"sha256": sha, "bytes": size}
                pending.discard(r)
        if pending:
            if time.monotonic() > deadline or not parent_alive():
                raise CheckpointError(f"step {job.step}: ranks {sorted(pending)} did not finish writing within "
                                      f"{plan.commit_timeout_s:.0f} s; the checkpoint was not published")
            time.sleep(0.02)
    index = {"format": FORMAT, "version": VERSION, "step": job.step, "world_size": plan.world_size,
             "metadata": job.metadata, "tensors": plan.tensors, "files": files}
    put(storage, f"{staging}/{INDEX}", [json.dumps(index).encode()])
    try:
        storage.publish(staging, final)
    except OSError as err:
        raise CheckpointError(f"{storage.describe()}/{staging}: publishing it as {final} failed: "
                              f"{_os_reason(err)}") from None
    try:  # published: the checkpoint is complete; a stale ``latest`` only costs a directory listing
        storage.put(LATEST, [final.encode()])
    except OSError:
        pass
    prune(storage, plan.keep, protect=job.step)


def prune(storage, keep: int, protect: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (never ``protect``: the one just
    published). The newest checkpoint is therefore never deleted, and since
    :meth:`lockstep.run.CheckpointPolicy.save` refuses non-finite weights, it is a finite one: pruning
    never deletes the last finite checkpoint (tests/train/test_nonfinite.py)."""
    if keep <= 0:
        return
    steps = sorted(s for s in complete_steps(storage) if s != protect)
    for s in steps[:max(len(steps) - (keep - 1), 0)]:
        storage.delete_tree(step_dir(s))


def complete_steps(storage) -> list[int]:
    """Steps with a published checkpoint (its index exists), oldest first."""
    out = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{INDEX}"):
            out.append(step)
    return sorted(out)


def recover_leftovers(storage) -> tuple[list[str], list[str]]:
    """Rank 0, before the first save of a run (fresh or resumed): tidy what interrupted saves left.

    Returns (removed, moved): only the staging directories of saves that never reached their index
    are removed (the writer's own scratch: never a checkpoint); everything else that could hold a
    checkpoint -- a step directory without its index, a staged save with its index, a replaced copy
    an interrupted publish left -- is moved into ``set-aside/`` (one line each in ``moved``)."""
    removed, moved = [], []
    staging_is_final = storage.staging_prefix("x") == "x"  # S3: an index-less step dir is the staging
    for name in storage.list_dir(""):
        has_index = storage.exists(f"{name}/{INDEX}")
        if name.endswith(".partial") and not has_index:
            storage.delete_tree(name)
            removed.append(name)
        elif name.endswith(".partial"):
            moved.append(f"{name} (a saved but unpublished checkpoint) -> {set_aside(storage, name, 'unpublished')}")
        elif name.startswith(".step-"):
            moved.append(f"{name} (a copy an interrupted publish replaced) -> {set_aside(storage, name, 'replaced')}")
        elif parse_step_dir(name) is not None and not has_index:
            what = "an interrupted save" if staging_is_final else "damaged, or an interrupted save"
            moved.append(f"{name} has no {INDEX} ({what}) -> {set_aside(storage, name, 'incomplete')}")
    return removed, moved


def set_aside(storage, name: str, reason: str) -> str:
    """Move the top-level entry ``name`` to ``set-aside/<name>.<reason>-<UTC time>`` (never a name a
    step directory parses as, so it is not loaded, counted or pruned); returns where it went.

    On a filesystem it is a rename; on an object store each object is copied, then the originals
    deleted (a crash in between leaves both copies, never neither)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = f"{ASIDE}/{name.lstrip('.')}.{reason}-{stamp}"
    if storage.exists(dest):
        dest += f"-{uuid.uuid4().hex[:6]}"
    if isinstance(storage, LocalStorage):
        (storage.root / ASIDE).mkdir(exist_ok=True)
        os.replace(storage.root / name, storage.root / dest)
        _fsync_dir(storage.root)
    else:
        _copy_tree(storage, name, dest)
        storage.delete_tree(name)
    return f"{storage.describe()}/{dest}"


def _copy_tree(storage, src: str, dst: str) -> None:
    names = storage.list_dir(src)
    if not names:  # a single object
        storage.put(dst, [storage.get(src)])
    for name in names:
        _copy_tree(storage, f"{src}/{name}", f"{dst}/{name}")


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_job(storage, plan: WritePlan, job: SaveJob, buffer: memoryview, parent_alive=lambda: True) -> dict:
    started = time.perf_counter()
    try:
        nbytes = write_rank_part(storage, plan, job, buffer)
        if plan.rank == 0:
            commit(storage, plan, job, parent_alive)
    except CheckpointError:
        if plan.rank == 0:  # the staging directory is shared; rank 0 gives up on it last (commit timeout)
            _drop_failed_staging(storage, job.step)
        raise
    seconds = time.perf_counter() - started
    return {"step": job.step, "write_s": seconds, "bytes": nbytes}


def _drop_failed_staging(storage, step: int) -> None:
    """A failed save's staging directory, unless it got its index (then start-up sets it aside): its
    files are never a checkpoint, and on a full disk they hold the space the next save needs."""
    staging = storage.staging_prefix(step_dir(step))
    try:  # on S3 staging is the final prefix: one with an index is complete (an earlier save's)
        if not storage.exists(f"{staging}/{INDEX}"):
            storage.delete_tree(staging)
    except OSError:
        pass  # start-up removes it


def attach_shared(name: str) -> shared_memory.SharedMemory:
    """Map the trainer's staging buffer. The spawned writer shares the trainer's resource tracker,
    which keeps one registration per name: the trainer's unlink clears it, and if the trainer is
    killed the tracker unlinks the segment once the writer, its last user, has exited."""
    return shared_memory.SharedMemory(name=name)


def writer_main(storage, jobs, results, parent_pid: int) -> None:
    """The background writer's loop (spawned process)."""
    lower_priority()  # normal unless LOCKSTEP_CKPT_WRITER_PRIORITY=idle (checkpoint/background.py)
    plan: WritePlan | None = None
    shm: shared_memory.SharedMemory | None = None
    buffer = memoryview(b"")

    def parent_alive() -> bool:
        return os.getppid() == parent_pid

    while True:
        try:
            message = jobs.get(timeout=0.5)
        except queue.Empty:
            if not parent_alive():
                return
            continue
        kind = message[0]
        if kind == "stop":
            return
        if kind == "plan":
            _, plan, name = message
            buffer.release()
            if shm is not None:
                shm.close()
            shm = attach_shared(name) if name else None
            buffer = shm.buf if shm is not None else memoryview(b"")
            continue
        job: SaveJob = message[1]
        try:
            results.put(("done", run_job(storage, plan, job, buffer, parent_alive)))
        except BaseException as err:  # report, keep serving: the next save may succeed
            results.put(("error", {"step": job.step, "error": f"{type(err).__name__}: {err}",
                                   "traceback": traceback.format_exc()}))
