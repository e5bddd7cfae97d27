"""Compile a C source set once per machine into a shared library and load it with ctypes.

(:func:`build_shared` is the cached build alone, for any compiler and link line:
:mod:`lockstep.ops.packed_op` builds a C++ torch-op library with it and loads that into torch.)

The library is built into ``$LOCKSTEP_CACHE`` (default ``~/.cache/lockstep``)``/kernels`` under a
name keyed by the sources, compiler version, flags and the CPU's feature flags (a second or so, once;
callers build one library per :mod:`lockstep.ops.isa` level they run, with its ``march_flags``),
built aside and published atomically so concurrent processes never load a half-written file. It is
loaded after torch, so a ``#pragma omp`` in it runs on torch's own OpenMP runtime and thread count.
``$LOCKSTEP_NO_C_KERNELS`` (any value) disables every C kernel: callers then take their fallbacks.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from lockstep.ops import isa


def build_library(name: str, sources: list[Path], flags: list[str], purpose: str) -> ctypes.CDLL | None:
    """``sources`` compiled with ``flags`` as ``<cache>/kernels/<name>-<key>.so`` and loaded; None
    (with a warning naming ``purpose`` when the compiler failed) where C kernels cannot be had."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    path = build_shared(name, sources, flags, purpose, compiler, ["-lm"])
    try:
        return None if path is None else ctypes.CDLL(str(path))
    except OSError:
        return None


def build_shared(name: str, sources: list[Path], flags: list[str], purpose: str, compiler: str | None,
                 libs: list[str]) -> Path | None:
    """``sources`` compiled by ``compiler`` with ``flags`` and linked with ``libs`` as the cached
    ``<cache>/kernels/<name>-<key>.so`` (built once, published atomically); its path, or None where it
    cannot be had (no compiler, ``$LOCKSTEP_NO_C_KERNELS``, a failed build: warned naming ``purpose``)."""
    if compiler is None or os.environ.get("LOCKSTEP_NO_C_KERNELS"):
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    linked = [] if libs == ["-lm"] else [" ".join(libs)]  # (the C libraries' keys as before this argument)
    key = hashlib.sha256("\0".join([*(src.read_text() for src in sources), version, " ".join(flags),
                                    isa.cpu_flags_line(), *linked]).encode())
    cache = Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep")) / "kernels"
    path = cache / f"{name}-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, publish atomically
                built = Path(tmp) / path.name
                result = subprocess.run([compiler, *flags, "-o", str(built), *map(str, sources), *libs],
                                        capture_output=True, text=True)
                if result.returncode != 0:
                    warnings.warn(f"lockstep: {purpose} did not build; using the fallback:\n{result.stderr[-2000:]}",
                                  RuntimeWarning, stacklevel=4)
                    return None
                os.replace(built, path)
        return path
    except OSError:
        return None
