"""The on-storage format: safetensors shards (written straight from the staging buffer) plus JSON.

A checkpoint ``step-00000100/`` holds, per rank, ``rank-00000-0.safetensors`` ... (that rank's
tensor chunks) and ``rank-00000.json`` (its non-tensor state: RNG, data loader; and the checksums
of its shards), and one ``index.json`` written last by rank 0: every tensor's global shape, dtype
and the chunks (file, offsets, shape) that tile it, with each file's byte size and sha256.
Loading parses JSON and safetensors only; nothing is unpickled. This module does not import
torch: the background writer process that uses it stays small and starts in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct

FORMAT = "lockstep-checkpoint"
VERSION = 1
INDEX = "index.json"
LATEST = "latest"

class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; names the file."""


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def rank_state_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor chunk inside a shard file: its key, dtype, local shape and byte range in the data."""

    key: str
    dtype: str  # safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]
    begin: int  # byte offset in the staging buffer
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ShardFile:
    """A safetensors file's entries; its data is the staging buffer's bytes ``[begin, end)``."""

    name: str
    entries: tuple[Entry, ...]

    @property
    def begin(self) -> int:
        return self.entries[0].begin

    @property
    def end(self) -> int:
        return self.entries[-1].begin + self.entries[-1].nbytes

    def header(self) -> bytes:
        """The safetensors length prefix + JSON header (padded to 8 bytes, as safetensors does)."""
        start = self.begin
        meta = {e.key: {"dtype": e.dtype, "shape": list(e.shape),
                        "data_offsets": [e.begin - start, e.begin - start + e.nbytes]} for e in self.entries}
        raw = json.dumps(meta, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw


def plan_shards(tensors: list[tuple[str, str, int, tuple[int, ...]]], prefix: str,
                max_file_bytes: int) -> tuple[list[ShardFile], int]:
    """Lay chunks ``(key, safetensors dtype, itemsize, shape)`` out in one flat buffer, widest
    dtypes first (so every view is aligned), cut into files of at most ``max_file_bytes`` (a larger
    single tensor gets a file of its own); returns the files and the buffer size.

    0-dim tensors (optimizer step counters) go to a small file of their own: every rank loading
    the checkpoint needs them, and should not have to read a big shard to get a few bytes."""
    ordered = sorted(tensors, key=lambda t: (len(t[3]) > 0, -t[2], t[0]))
    files: list[ShardFile] = []
    current: list[Entry] = []
    offset = file_start = 0
    for key, dtype, itemsize, shape in ordered:
        nbytes = itemsize * math.prod(shape)
        scalars_done = current and not current[-1].shape and shape
        if current and (scalars_done or offset + nbytes - file_start > max_file_bytes):
            files.append(ShardFile(f"{prefix}-{len(files)}.safetensors", tuple(current)))
            current = []
            if scalars_done:
                offset = -(-offset // 64) * 64  # realign after the scalars for the wide dtypes that follow
            file_start = offset
        current.append(Entry(key, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    if current:
        files.append(ShardFile(f"{prefix}-{len(files)}.safetensors", tuple(current)))
    return files, offset


def file_chunks(shard: ShardFile, buffer: memoryview) -> list[memoryview | bytes]:
    return [shard.header(), buffer[shard.begin:shard.end]]


def digest(chunks: list[memoryview | bytes]) -> tuple[str, int]:
    """sha256 hex and total size of the concatenated chunks (hashlib releases the GIL on big buffers)."""
    h = hashlib.sha256()
    size = 0
    for c in chunks:
        h.update(c)
        size += len(c)
    return h.hexdigest(), size


def verified_bytes(storage, key: str, expected: dict) -> bytes:
    """Read ``key`` and check its size and sha256 against the index; a mismatch names the file."""
    try:
        data = storage.get(key)
    except FileNotFoundError as err:
        raise CheckpointError(f"{storage.describe()}/{key}: listed in the checkpoint index but missing ({err})") \
            from None
    if len(data) != expected["bytes"]:
        raise CheckpointError(f"{storage.describe()}/{key}: corrupt checkpoint file: {len(data)} bytes, the "
                              f"index says {expected['bytes']} (truncated or overwritten)")
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected["sha256"]:
        raise CheckpointError(f"{storage.describe()}/{key}: corrupt checkpoint file: sha256 {actual[:16]}... "
                              f"does not match the index's {expected['sha256'][:16]}... (bit rot or tampering)")
    return data


def load_safetensors(data: bytes, key: str) -> dict:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as err:  # safetensors raises its own error type for malformed headers
        raise CheckpointError(f"{key}: not a readable safetensors file: {err}") from None
