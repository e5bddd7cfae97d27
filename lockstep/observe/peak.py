"""Measure (once per machine) the peak matmul throughput that MFU is reported against.

``peak_matmul_flops(dtype, threads)`` is the FLOP/s one thread reaches in ``torch.mm`` on square
matrices, times the number of threads (capped at the CPUs this process may run on): MFU is
measured against what the cores could deliver, not against what a multi-threaded run happened to
get. The one-thread figure is timed in the thread's own CPU time (``time.thread_time``), so time
the scheduler gives to other processes - other test workers, other ranks on the host, other
tenants - does not count; a wall-clock measurement taken on a busy host read the peak low (once a
third of the quiet value) and reported MFU above 1. The best of the first ``MIN_SAMPLES`` runs'
measurements is cached in ``<cache_dir>/peak_flops.json`` (``cache_dir`` is ``$LOCKSTEP_CACHE``
or ``~/.cache/lockstep``), keyed by CPU model, dtype and torch version. ``$LOCKSTEP_PEAK_FLOPS``
(a float, FLOP/s for the whole process) overrides everything. Concurrent processes serialise on a
lock file so only one measures while the others wait and then read the cache.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lockstep.observe._io import atomic_write_json
from lockstep.observe._sysinfo import cpu_model

ENV_OVERRIDE = "LOCKSTEP_PEAK_FLOPS"
ENV_CACHE = "LOCKSTEP_CACHE"
CACHE_FILE = "peak_flops.json"

DEFAULT_SIZE = 2048
_MIN_SIZE = 256
_MIN_REPEATS = 3
_MAX_REPEATS = 50
_BUDGET_S = 1.0  # timed repeats stop after this much wall time (at least _MIN_REPEATS run)


MIN_SAMPLES = 3


def cache_dir() -> Path:
    """Where lockstep keeps per-machine caches: ``$LOCKSTEP_CACHE`` or ``~/.cache/lockstep``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lockstep"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_key(dtype: torch.dtype) -> str:
    return f"{cpu_model()}|{_dtype_name(dtype)}|per_thread|torch={torch.__version__}"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def _num_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _time_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    # With one intra-op thread torch.mm runs in this thread, so its CPU time is the multiply's
    # compute time whatever else the host is running.
    start = time.thread_time()
    torch.mm(a, b, out=out)
    return time.thread_time() - start


def _measure(dtype: torch.dtype, size: int = DEFAULT_SIZE) -> tuple[float, int]:
    """Best-of-repeats one-thread FLOP/s of ``torch.mm`` at ``size``; returns (flops, size used).

    A slow warm-up multiply halves the size, so one dtype stays well under ~3 s."""
    with _num_threads(1), torch.no_grad():
        while True:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(size, size, generator=gen).to(dtype)
            b = torch.randn(size, size, generator=gen).to(dtype)
            out = torch.empty(size, size, dtype=dtype)
            warm = _time_mm(a, b, out)
            if warm <= _BUDGET_S / 4 or size <= _MIN_SIZE:
                break
            size //= 2
        best = warm
        spent = 0.0
        for i in range(1, _MAX_REPEATS + 1):
            t = _time_mm(a, b, out)
            best, spent = min(best, t), spent + t
            if i >= _MIN_REPEATS and spent > _BUDGET_S:
                break
    return 2.0 * size**3 / best, size


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no cross-process lock
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing or corrupt: treat as empty and re-measure
    return data if isinstance(data, dict) else {}


def peak_matmul_record(
    dtype: torch.dtype, threads: int | None = None, *, refresh: bool = False
) -> dict[str, Any]:
    """Peak matmul FLOP/s plus how it was obtained, for the run manifest.

    Keys: ``value`` (FLOP/s for ``threads`` threads), ``per_thread`` (one thread's FLOP/s, None if
    overridden), ``dtype``, ``threads``, ``cores_counted`` (threads capped at the usable CPUs),
    ``size`` (matrix side, None if overridden), ``measured_at`` (ISO UTC), ``cached`` (bool),
    ``source`` (``"env"``, ``"cache"`` or ``"measured"``), ``cpu``, ``torch``. ``refresh=True``
    ignores (and replaces) a cached value."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    cores = min(threads, usable_cpus())
    base = {"dtype": _dtype_name(dtype), "threads": threads, "cores_counted": cores,
            "cpu": cpu_model(), "torch": torch.__version__}
    env = os.environ.get(ENV_OVERRIDE)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"${ENV_OVERRIDE} must be a float FLOP/s, got {env!r}") from None
        if not value > 0:
            raise ValueError(f"${ENV_OVERRIDE} must be positive, got {env!r}")
        return {"value": value, "per_thread": None, **base, "size": None, "measured_at": None,
                "cached": False, "source": "env"}

    path = cache_dir() / CACHE_FILE
    key = _cache_key(dtype)
    with _locked(path.with_suffix(".lock")):
        hit = None if refresh else _read_cache(path).get(key)
        valid = isinstance(hit, dict) and isinstance(hit.get("per_thread"), (int, float))
        if valid and hit.get("samples", 1) >= MIN_SAMPLES:
            entry, source = hit, "cache"
        else:
            # CPU time leaves out descheduled time but not a neighbour's cache and memory traffic;
            # the cache keeps the best of the first MIN_SAMPLES runs' measurements.
            per_thread, size = _measure(dtype)
            samples = 1
            if valid:
                samples = hit.get("samples", 1) + 1
                if hit["per_thread"] > per_thread:
                    per_thread, size = hit["per_thread"], hit.get("size", size)
            entry = {"per_thread": per_thread, "size": size, "measured_at": _now(),
                     "samples": samples}
            cache = _read_cache(path)
            cache[key] = entry
            atomic_write_json(path, cache)
            source = "measured"
    return {"value": entry["per_thread"] * cores, **base, **entry, "cached": source == "cache",
            "source": source}


def peak_matmul_flops(dtype: torch.dtype, threads: int | None = None) -> float:
    """This machine's peak ``torch.mm`` throughput in FLOP/s for ``dtype`` at ``threads``
    (default: the current torch thread count, which is restored afterwards). Cached per machine."""
    return float(peak_matmul_record(dtype, threads)["value"])
