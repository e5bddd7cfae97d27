"""Reading a checkpoint into this rank's tensors, whatever layout saved it.

The index is checked against the target first (names, global shapes, dtypes: one error listing
every mismatch), then each needed shard is read once, front to back, and verified in the same
pass: its size is checked before anything is read, and its sha256 is computed on a worker thread
piece by piece as the main thread reads the next pieces (hashlib releases the GIL on large
buffers), so hashing overlaps reading and copying instead of being a second pass. A saved chunk
that a local slot holds whole, in contiguous CPU memory, is read straight into that slot (no
staging copy); any other is read into a scratch tensor and its overlap copied in. Coverage is
counted: a target element no chunk provides is an error, not a silently uninitialised weight.

Every checksum is compared before ``read_checkpoint`` returns: a corrupt shard raises
``CheckpointError`` naming the file. Because bytes land in the slots as they are read, the slots
may then hold part of the checkpoint; the caller gets the error, never a silently mixed state.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import queue
import struct
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lockstep.checkpoint.dtypes import DTYPE_NAMES, DTYPES_BY_NAME, SAFETENSORS_CODES
from lockstep.checkpoint.format import FORMAT, INDEX, CheckpointError, rank_state_file, step_dir, verified_bytes
from lockstep.checkpoint.layout import Slot, copy_overlap

#: bytes read (and handed to the hashing thread) at a time: large enough that hashlib releases
#: the GIL and per-call overhead vanishes, small enough that hashing starts early
PIECE = 16 << 20
_MAX_HEADER = 100 << 20
_DTYPE_OF_CODE = {code: dt for dt, code in SAFETENSORS_CODES.items()}


def read_index(storage, step: int) -> dict:
    key = f"{step_dir(step)}/{INDEX}"
    try:
        index = json.loads(storage.get(key))
    except FileNotFoundError:
        raise CheckpointError(f"{storage.describe()}/{key}: no such checkpoint (incomplete or deleted)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{storage.describe()}/{key}: unreadable checkpoint index: {err}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{storage.describe()}/{key}: not a lockstep checkpoint index")
    return index


def _mismatches(index: dict, slots: dict[str, Slot], job_names: set[str]) -> list[str]:
    saved = index["tensors"]
    problems = []
    missing = sorted(set(slots) - set(saved))
    unexpected = sorted(set(saved) - job_names)
    if missing:
        problems.append(f"{len(missing)} tensors the model needs are not in the checkpoint: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensors the model does not have: {_few(unexpected)}")
    wrong = []
    for name in sorted(set(slots) & set(saved)):
        slot, entry = slots[name], saved[name]
        if tuple(entry["shape"]) != slot.global_shape or entry["dtype"] != DTYPE_NAMES[slot.tensor.dtype]:
            wrong.append(f"{name}: saved {entry['dtype']}{list(entry['shape'])}, "
                         f"model {DTYPE_NAMES[slot.tensor.dtype]}{list(slot.global_shape)}")
    if wrong:
        problems.append(f"{len(wrong)} tensors differ in shape or dtype: " + _few(wrong))
    return problems


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def read_checkpoint(storage, step: int, slots: dict[str, Slot], rank: int,
                    job_names: set[str] | None = None) -> tuple[dict, dict]:
    """Fill ``slots`` from checkpoint ``step``; returns (rank state, metadata).

    ``job_names`` is every tensor name any rank of the job holds (pipeline stages hold disjoint
    parts); a checkpoint tensor no rank holds is reported as unexpected. Defaults to ``slots``."""
    index = read_index(storage, step)
    where = f"{storage.describe()}/{step_dir(step)}"
    problems = _mismatches(index, slots, set(slots) if job_names is None else job_names)
    if problems:
        meta = index.get("metadata", {})
        saved_model = f" (saved from {meta.get('family')} {meta.get('flavor')})" if meta.get("family") else ""
        raise CheckpointError(f"{where}: checkpoint does not match this model{saved_model}:\n  - "
                              + "\n  - ".join(problems))
    needed: dict[str, list[tuple[str, dict]]] = {}
    for name, slot in slots.items():
        for chunk in index["tensors"][name]["chunks"]:
            if slot.tensor.ndim == 0 or _intersects(slot, chunk):
                needed.setdefault(chunk["file"], []).append((name, chunk))
    covered = {name: 0 for name in slots}
    for file in needed:
        if file not in index["files"]:
            raise CheckpointError(f"{where}/{INDEX}: names shard {file} without a checksum")
    workers = max(1, min(len(needed), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lockstep-ckpt-verify") as pool:
        hashes = []
        for file, chunks in sorted(needed.items()):
            expected = index["files"][file]
            hashes.append((file, expected, _read_shard(storage, f"{step_dir(step)}/{file}", expected, chunks,
                                                       slots, covered, pool)))
        for file, expected, digest in hashes:  # every shard is read: now every checksum must match
            actual = digest.result()
            if actual != expected["sha256"]:
                raise CheckpointError(f"{where}/{file}: corrupt checkpoint file: sha256 {actual[:16]}... does "
                                      f"not match the index's {expected['sha256'][:16]}... (bit rot or tampering)")
    short = [n for n, c in covered.items() if c < math.prod(slots[n].shape)]
    if short:
        raise CheckpointError(f"{where}: the saved chunks do not cover {_few(short)} (damaged index)")
    state_file = rank_state_file(rank)
    if state_file not in index["files"]:
        state_file = rank_state_file(0)  # a run with fewer ranks saved this one: rank 0's state is global
    rank_state = json.loads(verified_bytes(storage, f"{step_dir(step)}/{state_file}", index["files"][state_file]))
    return rank_state["state"], index.get("metadata", {})


def _open(storage, key: str):
    """A binary file object with ``readinto`` for ``key`` (a storage without ``open_read``: its bytes)."""
    try:
        opener = getattr(storage, "open_read", None)
        return opener(key) if opener is not None else io.BytesIO(storage.get(key))
    except FileNotFoundError as err:
        raise CheckpointError(f"{storage.describe()}/{key}: listed in the checkpoint index but missing ({err})") \
            from None
    except OSError as err:
        raise CheckpointError(f"{storage.describe()}/{key}: cannot read checkpoint file: {err}") from None


def _hash_pieces(pieces: queue.SimpleQueue) -> str:
    """The sha256 of the pieces put on ``pieces`` until ``None`` (runs on a worker thread)."""
    h = hashlib.sha256()
    while (piece := pieces.get()) is not None:
        h.update(piece)
    return h.hexdigest()


def _read_shard(storage, key: str, expected: dict, chunks: list[tuple[str, dict]], slots: dict[str, Slot],
                covered: dict[str, int], pool: ThreadPoolExecutor) -> Future:
    """Read shard ``key`` once, front to back: each needed chunk into its slot, every byte handed to
    a hashing task on ``pool``; returns that task's future (the file's sha256 hex)."""
    name = f"{storage.describe()}/{key}"
    f = _open(storage, key)
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    digest = pool.submit(_hash_pieces, pieces)
    try:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        if size != expected["bytes"]:
            raise CheckpointError(f"{name}: corrupt checkpoint file: {size} bytes, the index says "
                                  f"{expected['bytes']} (truncated or overwritten)")
        if isinstance(f, io.FileIO) and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a cold read streams
        reader = _Reader(f, name, size, pieces)
        entries = _header_entries(reader, name)
        wanted = {chunk_name: chunk for chunk_name, chunk in chunks}
        for entry_name, dtype, shape, begin, end in entries:
            reader.skip_to(begin)  # bytes between tensors (none in lockstep's files) are hashed too
            chunk = wanted.pop(entry_name, None)
            if chunk is None:
                reader.skip_to(end)  # another rank's chunk: only hashed
                continue
            slot = slots[entry_name]
            if shape != tuple(chunk["shape"]) or dtype != slot.tensor.dtype:
                raise CheckpointError(f"{name}: corrupt checkpoint file: {entry_name} is {dtype}{list(shape)} "
                                      f"in the file, the index says {chunk['shape']}")
            direct = _whole_chunk_view(slot, chunk)
            if direct is not None:
                reader.read_into(direct)
                covered[entry_name] += math.prod(shape)
            else:
                scratch = torch.empty(end - begin, dtype=torch.uint8)
                reader.read_into(scratch)
                covered[entry_name] += copy_overlap(slot, scratch.view(dtype).view(shape), tuple(chunk["offsets"]))
        if wanted:
            raise CheckpointError(f"{name}: tensor {next(iter(wanted))} listed in the index is missing")
        reader.skip_to(size)
    finally:
        pieces.put(None)
        f.close()
    return digest


class _Reader:
    """Sequential reads of one file; every byte read goes to the hashing queue, in order."""

    def __init__(self, f, name: str, size: int, pieces: queue.SimpleQueue) -> None:
        self.f, self.name, self.size, self.pieces, self.pos = f, name, size, pieces, 0

    def read_into(self, target: torch.Tensor | bytearray) -> None:
        view = memoryview(target.numpy() if isinstance(target, torch.Tensor) else target).cast("B")
        if self.pos + len(view) > self.size:
            raise CheckpointError(f"{self.name}: corrupt checkpoint file: data past the end of the file")
        for start in range(0, len(view), PIECE):
            piece = view[start:start + PIECE]
            got = 0
            while got < len(piece):
                n = self.f.readinto(piece[got:])
                if not n:
                    raise CheckpointError(f"{self.name}: corrupt checkpoint file: it ended at byte "
                                          f"{self.pos + start + got} while being read (truncated)")
                got += n
            self.pieces.put(piece)
        self.pos += len(view)

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(buf)
        return bytes(buf)

    def skip_to(self, pos: int) -> None:
        while self.pos < pos:
            self.read_into(bytearray(min(pos - self.pos, PIECE)))


def _header_entries(reader: _Reader, name: str) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """The safetensors header's tensors as (name, dtype, shape, begin, end) in absolute file
    offsets, sorted, checked to lie inside the file without overlapping; a bad header names the file."""
    (length,) = struct.unpack("<Q", reader.read(8)) if reader.size >= 8 else (-1,)
    if not 0 < length <= min(reader.size - 8, _MAX_HEADER):
        raise CheckpointError(f"{name}: corrupt checkpoint file: not a safetensors file (header length {length})")
    try:
        meta = json.loads(reader.read(length))
        out = []
        for key, info in meta.items():
            if key == "__metadata__":
                continue
            shape = tuple(int(d) for d in info["shape"])
            dtype = _DTYPE_OF_CODE[info["dtype"]]
            begin, end = (8 + length + int(o) for o in info["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize or min(shape, default=0) < 0:
                raise ValueError(f"{key}: {end - begin} bytes for {info['dtype']}{list(shape)}")
            out.append((key, dtype, shape, begin, end))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{name}: corrupt checkpoint file: unreadable safetensors header: {err}") from None
    out.sort(key=lambda e: e[3])
    last = 8 + length
    for key, _dtype, _shape, begin, end in out:
        if begin < last or end > reader.size:
            raise CheckpointError(f"{name}: corrupt checkpoint file: tensor {key}'s bytes [{begin}, {end}) overlap "
                                  f"another's or lie outside the file ({reader.size} bytes)")
        last = end
    return out


def _whole_chunk_view(slot: Slot, chunk: dict) -> torch.Tensor | None:
    """The bytes of ``slot`` that saved ``chunk`` fills entirely, as a writable uint8 tensor, when
    the chunk lies wholly inside the slot, in contiguous CPU memory; else None."""
    t = slot.tensor.detach()
    if t.device.type != "cpu" or t.ndim != len(chunk["shape"]):
        return None
    index = []
    for o, n, co, cn in zip(slot.offsets, slot.shape, chunk["offsets"], chunk["shape"]):
        if co < o or co + cn > o + n:
            return None
        index.append(slice(co - o, co - o + cn))
    view = t[tuple(index)]
    if not view.is_contiguous():
        return None
    return view.reshape(-1).view(torch.uint8)


def _intersects(slot: Slot, chunk: dict) -> bool:
    return all(max(a, b) < min(a + n, b + m)
               for a, n, b, m in zip(slot.offsets, slot.shape, chunk["offsets"], chunk["shape"]))


def read_full_state(storage, step: int | None = None) -> tuple[int, dict, dict]:
    """Every tensor of a checkpoint, unsharded, in one process: (step, {name: tensor}, metadata).
    For inspection, export and tests; checks every shard's checksum on the way."""
    import torch

    from lockstep.checkpoint.checkpointer import latest_step

    if step is None:
        step = latest_step(storage)
        if step is None:
            raise CheckpointError(f"{storage.describe()}: no complete checkpoint to load")
    index = read_index(storage, step)
    tensors = {name: torch.empty(entry["shape"], dtype=DTYPES_BY_NAME[entry["dtype"]])
               for name, entry in index["tensors"].items()}
    read_checkpoint(storage, step, {n: Slot.of(t) for n, t in tensors.items()}, rank=0)
    return step, tensors, index.get("metadata", {})
