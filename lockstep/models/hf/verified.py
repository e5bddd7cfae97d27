"""Weight files that verify themselves: safetensors files carrying sha256 checksums in their header.

Every weights file lockstep writes (a run's ``model.safetensors``, lockstep model directories, Hugging
Face exports and their shards) goes through :func:`write_weights`: a standard safetensors file
(``safetensors`` and ``transformers`` read it unchanged) whose ``__metadata__`` also holds

- ``lockstep.data_sha256``: sha256 of the data region (every tensor byte, in file order);
- ``lockstep.table_sha256``: sha256 of the header without these two keys (canonical JSON: names,
  dtypes, shapes, offsets, other metadata), so a damaged header is named as such.

The writer hashes each chunk as it writes it (a placeholder digest first, then the header rewritten
in place: a hex digest always has 64 characters). The reader parses and checks the header itself
(never a raw ``SafetensorError``) and hashes each chunk right after reading it into the tensor that
needs it, on a second thread while the next chunk is read: verifying costs no second pass over the
file. Any problem is one :class:`WeightsError` naming the file and what is wrong.

Files without checksums (third-party Hugging Face directories, files of an older lockstep) cannot be
verified: loading them needs ``allow_unverified`` (``--allow-unverified-weights``), and then warns;
a checksum that is present is always checked (docs/generation.md, "Verified weights").
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import math
import os
import struct
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from lockstep.config.base import ConfigError

DATA_KEY = "lockstep.data_sha256"
TABLE_KEY = "lockstep.table_sha256"
PRODUCER = {"format": "pt", "producer": "lockstep"}
#: the user-facing names of the opt-out (CLI flag; Python keyword)
FLAG = "--allow-unverified-weights"
KWARG = "allow_unverified=True"
_CHUNK = 1 << 20  # hashed while still in cache
_QUEUED = 32  # chunks read ahead of the hasher
_MAX_HEADER = 100_000_000  # safetensors' own limit
_PLACEHOLDER = "0" * 64
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_CODES = {v: k for k, v in _DTYPES.items()}


class WeightsError(ConfigError):
    """A weights file is damaged (truncated, bad header, checksum mismatch) or cannot be verified;
    the message names the file and what is wrong, on one line."""


class UnverifiedWeightsWarning(UserWarning):
    """Weights without checksums were loaded because ``allow_unverified`` was given."""


def _bytes_of(tensor: torch.Tensor):  # noqa: ANN202 - a numpy uint8 view (buffer protocol)
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _table_digest(header: dict) -> str:
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k not in (DATA_KEY, TABLE_KEY)}
    canonical = {**{k: v for k, v in header.items() if k != "__metadata__"}, "__metadata__": meta}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _encode_header(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write(out: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, where: str) -> str:
    """Write the checksummed file to ``out`` (seekable) from its start; returns the data sha256.
    Tensors are laid out as safetensors does (widest dtype first, then by name), so every tensor is
    aligned for readers that map the file."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": {**PRODUCER, **(metadata or {})}}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _CODES:
            raise WeightsError(f"{where}: tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"][TABLE_KEY] = _table_digest(header)
    header["__metadata__"][DATA_KEY] = _PLACEHOLDER
    placeholder = _encode_header(header)
    digest = hashlib.sha256()
    out.write(placeholder)
    for name in order:
        data = _bytes_of(tensors[name].detach().cpu().contiguous())
        for start in range(0, len(data), _CHUNK):
            piece = data[start:start + _CHUNK]
            digest.update(piece)
            out.write(piece)
    header["__metadata__"][DATA_KEY] = digest.hexdigest()
    final = _encode_header(header)
    assert len(final) == len(placeholder)  # the digest replaced a placeholder of its own length
    out.seek(0)
    out.write(final)
    return digest.hexdigest()


def write_weights(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str],
                  metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` as a checksummed safetensors file, atomically (temporary file, fsync,
    rename; an OSError propagates); returns the data sha256."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            digest = _write(out, tensors, metadata, str(path))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest


def encode_weights(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The checksummed safetensors file as bytes, for a caller with its own atomic writer."""
    buffer = io.BytesIO()
    _write(buffer, tensors, metadata, "encode_weights")
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a weights file: its dtype, shape and byte range within the data region."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class WeightsHeader:
    """A weights file's checked header: tensors in file order, metadata, where the data starts."""

    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int

    @property
    def checksum(self) -> str | None:
        """The data sha256 the file carries (None: written without checksums)."""
        return self.metadata.get(DATA_KEY)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: e.shape for name, e in self.entries.items()}


def _corrupt(path: Path, what: str) -> WeightsError:
    return WeightsError(f"{path}: corrupt weights file: {what}")


def read_header(path: str | os.PathLike[str]) -> WeightsHeader:
    """Parse and check ``path``'s safetensors header (and its table checksum, when present)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            raw = handle.read(n) if n is not None and 8 + n <= size and n <= _MAX_HEADER else b""
    except FileNotFoundError:
        raise WeightsError(f"{path}: file not found") from None
    except OSError as err:
        raise WeightsError(f"{path}: cannot read ({err.strerror or err})") from None
    if n is None:
        raise _corrupt(path, f"truncated: {size} bytes, shorter than the 8-byte header length")
    if n > _MAX_HEADER or 8 + n > size:
        raise _corrupt(path, f"bad header: it claims {n} bytes but the file holds {size} (truncated, or not a "
                             "safetensors file)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise _corrupt(path, f"bad header: not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "bad header: not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "bad header: __metadata__ is not a string -> string object")
    entries = _entries(path, header)
    data_size, expected = size - 8 - n, max((e.end for e in entries.values()), default=0)
    if data_size < expected:
        raise _corrupt(path, f"truncated: the header describes {expected} bytes of tensor data, the file holds "
                             f"{data_size}")
    if data_size > expected:
        raise _corrupt(path, f"{data_size - expected} unexpected bytes after the last tensor")
    if (DATA_KEY in metadata) != (TABLE_KEY in metadata):
        raise _corrupt(path, f"bad header: holds only one of {DATA_KEY} and {TABLE_KEY}")
    if TABLE_KEY in metadata and _table_digest(header) != metadata[TABLE_KEY]:
        raise _corrupt(path, "bad header: the tensor table does not match its checksum (the header was damaged "
                             "or edited)")
    return WeightsHeader(path, entries, dict(metadata), 8 + n)


def _entries(path: Path, header: dict) -> dict[str, Entry]:
    """The tensor table in file order; offsets must tile the data region exactly, as safetensors requires."""
    entries: list[tuple[str, Entry]] = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
            if any(d < 0 for d in shape) or any(not isinstance(d, int) for d in spec["shape"]):
                raise ValueError("negative or non-integer dimension")
        except (KeyError, TypeError, ValueError) as err:
            raise _corrupt(path, f"bad header: tensor {name!r}: unreadable entry ({err!r})") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise _corrupt(path, f"bad header: tensor {name!r}: {list(shape)} {spec['dtype']} needs {nbytes} bytes, "
                                 f"its offsets span {end - begin}")
        entries.append((name, Entry(dtype, shape, begin, end)))
    entries.sort(key=lambda item: (item[1].begin, item[1].end))
    position = 0
    for name, entry in entries:
        if entry.begin != position:
            raise _corrupt(path, f"bad header: tensor {name!r} starts at byte {entry.begin}, expected {position} "
                                 "(overlapping or gapped offsets)")
        position = entry.end
    return dict(entries)


def require_checksums(headers: Iterable[WeightsHeader], allow_unverified: bool, what: str) -> None:
    """Refuse (or, with ``allow_unverified``, warn about) files that carry no checksums; ``what``
    says what is being loaded."""
    bare = [h.path for h in headers if h.checksum is None]
    if not bare:
        return
    files = f"{bare[0]}" + (f" (and {len(bare) - 1} more file(s))" if len(bare) > 1 else "")
    if not allow_unverified:
        raise WeightsError(f"{files}: carries no lockstep checksums, so {what} cannot be verified (a third-party "
                           f"file or one an older lockstep wrote); pass {FLAG} ({KWARG} in Python) to load it "
                           "unverified")
    warnings.warn(f"{files}: no checksums; {what} loaded unverified ({FLAG})", UnverifiedWeightsWarning,
                  stacklevel=3)


class _Hasher:
    """sha256 of the pieces handed to it, in order, computed on one worker thread (hashlib releases
    the GIL) in batches of at least a chunk, so many small tensors cost few hand-offs."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.digest = hashlib.sha256()
        self.pool = pool
        self.batch: list[memoryview] = []
        self.size = 0
        self.pending: collections.deque[Future] = collections.deque()

    def add(self, piece: memoryview) -> None:
        self.batch.append(piece)
        self.size += len(piece)
        if self.size >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch, self.size = self.batch, [], 0
            self.pending.append(self.pool.submit(lambda: [self.digest.update(p) for p in batch]))
            if len(self.pending) > _QUEUED:  # bounded read-ahead
                self.pending.popleft().result()

    def hexdigest(self) -> str:
        self._flush()
        while self.pending:
            self.pending.popleft().result()
        return self.digest.hexdigest()


def read_tensors(header: WeightsHeader, names: Iterable[str] | None = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors ``names`` (default: all) of a file; when it carries a checksum, every data byte is
    hashed as it is read (also those of tensors not asked for) and a mismatch is a WeightsError.
    ``dtype`` casts floating-point tensors."""
    wanted = set(header.entries) if names is None else set(names)
    verify = header.checksum is not None
    out: dict[str, torch.Tensor] = {}
    try:
        with open(header.path, "rb") as handle, ThreadPoolExecutor(max_workers=1) as pool:
            hasher = _Hasher(pool)
            handle.seek(header.data_start)
            for name, entry in header.entries.items():
                if name not in wanted and not verify:
                    handle.seek(entry.end - entry.begin, os.SEEK_CUR)
                    continue
                tensor = torch.empty(entry.shape, dtype=entry.dtype) if name in wanted else None
                data = _bytes_of(tensor) if tensor is not None else None
                for start in range(0, entry.end - entry.begin, _CHUNK):
                    stop = min(start + _CHUNK, entry.end - entry.begin)
                    # a fresh scratch buffer for bytes nobody wants: the hasher may still be reading the last one
                    piece = memoryview(data[start:stop]) if data is not None else memoryview(bytearray(stop - start))
                    if handle.readinto(piece) != stop - start:
                        raise _corrupt(header.path, f"truncated while reading tensor {name!r} (the file shrank?)")
                    if verify:
                        hasher.add(piece)
                if tensor is not None:
                    out[name] = tensor
            actual = hasher.hexdigest() if verify else None
    except OSError as err:
        raise WeightsError(f"{header.path}: cannot read ({err.strerror or err})") from None
    if verify and actual != header.checksum:
        raise _corrupt(header.path, f"sha256 of the tensor data is {actual[:16]}..., the header says "
                                    f"{header.checksum[:16]}... (bit rot, a partial copy or tampering)")
    for name, tensor in out.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.to(device)
    return out
