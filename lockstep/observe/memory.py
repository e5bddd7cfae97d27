"""Host (and, when present, CUDA) memory readings for the metrics stream.

``peak_rss_bytes`` is the process high-water mark, ``current_rss_bytes`` the resident set now.
"""

from __future__ import annotations

import os
import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss``: KiB on Linux, bytes on
    macOS). The kernel updates the high-water mark lazily, so it is floored at the current RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(rss) if sys.platform == "darwin" else int(rss) * 1024
    return max(peak, current_rss_bytes())


def current_rss_bytes() -> int:
    """Resident set size of this process right now, in bytes (psutil, else /proc/self/statm)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        pass
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_metrics() -> dict[str, float]:
    """``mem/rss_gib``, ``mem/peak_rss_gib`` and, on CUDA, ``mem/cuda_peak_gib`` for one log line."""
    gib = float(1 << 30)
    out = {"mem/rss_gib": current_rss_bytes() / gib, "mem/peak_rss_gib": peak_rss_bytes() / gib}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["mem/cuda_peak_gib"] = torch.cuda.max_memory_allocated() / gib
    return out
