"""Small, never-failing probes of the host: CPU model, ISA flags and total memory.

Used by the peak-FLOPs cache key and the run manifest's hardware section.
"""

from __future__ import annotations

import functools
import os
import platform

# ISA flags that decide which matmul kernels a CPU can run (bf16/AMX tiles matter most).
_INTERESTING_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as a dict (empty off Linux)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def cpu_model() -> str:
    """The CPU model string, e.g. ``"AMD EPYC 9654 96-Core Processor"``; never raises."""
    info = _cpuinfo()
    name = info.get("model name") or info.get("Processor") or info.get("cpu model")
    return name or platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str]:
    """Which of the matmul-relevant ISA flags this CPU reports (Linux only; else empty)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return [f for f in _INTERESTING_FLAGS if f in flags]


def total_memory_bytes() -> int | None:
    """Physical memory in bytes, or None when it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def usable_cores() -> int | None:
    """Cores this process may run on (affinity mask), falling back to the logical core count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()
