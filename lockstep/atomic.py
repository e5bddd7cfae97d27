"""Atomic file writes: the one way lockstep replaces a file (weights, run outputs, data caches).

The bytes go to a temporary file in the same folder, are fsync'ed, and the file is renamed over the
target: a crash or a full disk leaves the old file (or none), never a truncated one that looks whole.
Callers turn an ``OSError`` into their own one-line error naming the path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


class FilesystemError(RuntimeError):
    """Creating, writing or reading a run's files failed; the message names the path and the operation."""


def os_reason(err: OSError) -> str:
    """``strerror (errno N)``: the OS's reason, without Python's repetition of the path."""
    return f"{err.strerror} (errno {err.errno})" if err.strerror else str(err)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary handle whose contents replace ``path`` when the block ends without an exception;
    on an exception the temporary file is removed and the exception propagates."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
