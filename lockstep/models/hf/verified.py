"""Weight files that verify themselves: safetensors files carrying sha256 checksums in their header.

Every weights file lockstep writes (a run's ``model.safetensors``, lockstep model directories, Hugging
Face exports and their shards) goes through :func:`write_weights`: a standard safetensors file
(``safetensors`` and ``transformers`` read it unchanged) whose ``__metadata__`` also holds

- ``lockstep.data_sha256``: the sha256 of each ``lockstep.block_bytes`` (32 MiB) block of the data
  region (every tensor byte, in file order), comma-separated: blocks hash in parallel, on every core;
- ``lockstep.table_sha256``: sha256 of the header without these two keys (canonical JSON: names,
  dtypes, shapes, offsets, other metadata), so a damaged header is named as such.

The writer hashes the bytes as it writes them (placeholder digests first, then the header rewritten
in place: a hex digest always has 64 characters). The reader parses and checks the header itself
(never a raw ``SafetensorError``), reads each tensor's bytes once into the tensor, and hands each
completed block to a thread pool while it reads on: verifying costs no second pass over the file,
and about the hashing time divided by the cores. Any problem is one :class:`WeightsError` naming
the file and what is wrong (a mismatch names the block's tensors).

Files without checksums (third-party Hugging Face directories, files of an older lockstep) cannot be
verified: loading them needs ``allow_unverified`` (``--allow-unverified-weights``), and then warns;
a checksum that is present is always checked (docs/generation.md, "Verified weights").
"""

from __future__ import annotations

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

from lockstep.atomic import atomic_open
from lockstep.config.base import ConfigError

DATA_KEY = "lockstep.data_sha256"
TABLE_KEY = "lockstep.table_sha256"
BLOCK_KEY = "lockstep.block_bytes"
BLOCK_BYTES = 32 << 20
PRODUCER = {"format": "pt", "producer": "lockstep"}
#: the user-facing names of the opt-out (CLI flag; Python keyword)
FLAG = "--allow-unverified-weights"
KWARG = "allow_unverified=True"
_CHUNK = 4 << 20  # one read call
_WORKERS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
_MAX_HEADER = 100_000_000  # safetensors' own limit
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


def _sha256(pieces: list[memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


class _BlockHasher:
    """The sha256 of each ``block``-byte block of a byte stream handed over in pieces, in order. Each
    completed block is hashed on ``pool`` (hashlib releases the GIL), while the caller goes on
    reading or writing; at most two blocks per worker are in flight (the pieces stay alive until then)."""

    def __init__(self, pool: ThreadPoolExecutor, block: int) -> None:
        self.pool, self.block = pool, block
        self.pieces: list[memoryview] = []
        self.size = 0
        self.futures: list[Future] = []
        self.done = 0

    def add(self, piece: memoryview) -> None:
        while len(piece):
            take = min(len(piece), self.block - self.size)
            self.pieces.append(piece[:take])
            self.size += take
            piece = piece[take:]
            if self.size == self.block:
                self._submit()

    def _submit(self) -> None:
        pieces, self.pieces, self.size = self.pieces, [], 0
        self.futures.append(self.pool.submit(_sha256, pieces))
        if len(self.futures) - self.done > 2 * _WORKERS:
            self.futures[self.done].result()
            self.done += 1

    def hexdigests(self) -> list[str]:
        if self.pieces:
            self._submit()
        return [f.result() for f in self.futures]


def _placeholder(data_bytes: int, block: int) -> str:
    return ",".join(["0" * 64] * -(-data_bytes // block))


def _write(out: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, where: str) -> str:
    """Write the checksummed file to ``out`` (seekable) from its start; returns its data checksum
    (the block digests). Tensors are laid out as safetensors does (widest dtype first, then by
    name), so every tensor is aligned for readers that map the file."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": {**PRODUCER, **(metadata or {}), BLOCK_KEY: str(BLOCK_BYTES)}}
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
    header["__metadata__"][DATA_KEY] = _placeholder(offset, BLOCK_BYTES)
    placeholder = _encode_header(header)
    out.write(placeholder)
    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        hasher = _BlockHasher(pool, BLOCK_BYTES)
        for name in order:
            data = memoryview(_bytes_of(tensors[name].detach().cpu().contiguous()))
            hasher.add(data)
            for start in range(0, len(data), _CHUNK):
                out.write(data[start:start + _CHUNK])
        checksum = ",".join(hasher.hexdigests())
    header["__metadata__"][DATA_KEY] = checksum
    final = _encode_header(header)
    assert len(final) == len(placeholder)  # each digest replaced a placeholder of its own length
    out.seek(0)
    out.write(final)
    return checksum


def write_weights(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str],
                  metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` as a checksummed safetensors file, atomically (temporary file, fsync,
    rename: a full disk leaves no truncated file behind); returns its data checksum. An OS error is
    a WeightsError naming the file."""
    path = Path(path)
    try:
        with atomic_open(path) as out:
            digest = _write(out, tensors, metadata, str(path))
    except OSError as err:
        raise WeightsError(f"{path}: writing the weights failed: {err.strerror or err}") from None
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
        """The data checksum the file carries: its blocks' sha256, comma-separated (None: written
        without checksums)."""
        return self.metadata.get(DATA_KEY)

    @property
    def block_bytes(self) -> int:
        return int(self.metadata[BLOCK_KEY])

    def tensors_in(self, begin: int, end: int) -> list[str]:
        """Names of the tensors overlapping data bytes ``[begin, end)``."""
        return [name for name, e in self.entries.items() if e.begin < end and e.end > begin]

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
    if TABLE_KEY in metadata:
        if _table_digest(header) != metadata[TABLE_KEY]:
            raise _corrupt(path, "bad header: the tensor table does not match its checksum (the header was "
                                 "damaged or edited)")
        block = int(metadata[BLOCK_KEY]) if metadata.get(BLOCK_KEY, "").isdigit() else 0
        digests = metadata[DATA_KEY].split(",") if metadata[DATA_KEY] else []
        if block <= 0 or len(digests) != -(-data_size // block) or any(len(d) != 64 for d in digests):
            raise _corrupt(path, f"bad header: {DATA_KEY} is not one sha256 per {BLOCK_KEY} block of the data")
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


def _compare(header: WeightsHeader, actual: list[str]) -> None:
    """A WeightsError naming the first block whose sha256 differs from the header's, and its tensors."""
    expected = header.checksum.split(",") if header.checksum else []
    bad = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    if not bad:
        return
    block = header.block_bytes
    begin = bad[0] * block
    end = min(begin + block, max((e.end for e in header.entries.values()), default=0))
    names = header.tensors_in(begin, end)
    shown = ", ".join(names[:3]) + (f", ... ({len(names) - 3} more)" if len(names) > 3 else "")
    raise _corrupt(header.path, f"sha256 of data bytes [{begin}, {end}) (tensor(s) {shown}) is {actual[bad[0]][:16]}"
                                f"..., the header says {expected[bad[0]][:16]}...; {len(bad)} of {len(expected)} "
                                "block(s) differ (bit rot, a partial copy or tampering)")


def read_tensors(header: WeightsHeader, names: Iterable[str] | None = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors ``names`` (default: all) of a file; when it carries a checksum, every data byte is
    hashed as it is read (also those of tensors not asked for) and a mismatch is a WeightsError.
    ``dtype`` casts floating-point tensors."""
    wanted = set(header.entries) if names is None else set(names)
    verify = header.checksum is not None
    out: dict[str, torch.Tensor] = {}
    try:
        with open(header.path, "rb") as handle, ThreadPoolExecutor(max_workers=_WORKERS) as pool:
            hasher = _BlockHasher(pool, header.block_bytes if verify else 1)
            handle.seek(header.data_start)
            for name, entry in header.entries.items():
                if name not in wanted and not verify:
                    handle.seek(entry.end - entry.begin, os.SEEK_CUR)
                    continue
                tensor = torch.empty(entry.shape, dtype=entry.dtype) if name in wanted else None
                data = _bytes_of(tensor) if tensor is not None else None
                for start in range(0, entry.end - entry.begin, _CHUNK):
                    stop = min(start + _CHUNK, entry.end - entry.begin)
                    # a fresh scratch buffer for bytes nobody wants: a hashing thread may still read the last one
                    piece = memoryview(data[start:stop]) if data is not None else memoryview(bytearray(stop - start))
                    if handle.readinto(piece) != stop - start:
                        raise _corrupt(header.path, f"truncated while reading tensor {name!r} (the file shrank?)")
                    if verify:
                        hasher.add(piece)
                if tensor is not None:
                    out[name] = tensor
            actual = hasher.hexdigests() if verify else []
    except OSError as err:
        raise WeightsError(f"{header.path}: cannot read ({err.strerror or err})") from None
    if verify:
        _compare(header, actual)
    for name, tensor in out.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.to(device)
    return out
