"""Measurement and run records for a trainer: peak FLOPs, stage timing, memory, the metrics
stream, the run manifest, plots, console progress and MFU arithmetic."""

from lockstep.observe.console import ProgressBar, format_summary, format_value
from lockstep.observe.manifest import (
    RunManifest,
    collect_determinism,
    collect_hardware,
    collect_versions,
    read_manifest,
)
from lockstep.observe.memory import current_rss_bytes, memory_metrics, peak_rss_bytes
from lockstep.observe.metrics import MetricsWriter, read_metrics, sanitize_record
from lockstep.observe.mfu import mfu, tokens_per_second
from lockstep.observe.peak import cache_dir, peak_matmul_flops, peak_matmul_record
from lockstep.observe.timer import StageTimer

_LAZY = {"plot_loss": "lockstep.observe.plots", "plot_series": "lockstep.observe.plots"}


def __getattr__(name: str) -> object:
    """Import the plotting helpers (and matplotlib, ~0.3 s) only when first used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MetricsWriter",
    "ProgressBar",
    "RunManifest",
    "StageTimer",
    "cache_dir",
    "collect_determinism",
    "collect_hardware",
    "collect_versions",
    "current_rss_bytes",
    "format_summary",
    "format_value",
    "memory_metrics",
    "mfu",
    "peak_matmul_flops",
    "peak_matmul_record",
    "peak_rss_bytes",
    "plot_loss",
    "plot_series",
    "read_manifest",
    "read_metrics",
    "sanitize_record",
    "tokens_per_second",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
