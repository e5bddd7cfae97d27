"""Throughput arithmetic: tokens per second and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s, with the peak from :mod:`lockstep.observe.peak`.
It is not clamped: a value above 1 means ``flops_per_token`` is over-counted (or the peak is low),
and hiding that would hide the bug.
"""

from __future__ import annotations


def tokens_per_second(tokens: float, seconds: float) -> float:
    """``tokens / seconds``; 0.0 when no time has elapsed (rather than dividing by zero)."""
    if tokens < 0 or seconds < 0:
        raise ValueError(f"tokens and seconds must be >= 0, got {tokens}, {seconds}")
    return float(tokens) / seconds if seconds > 0 else 0.0


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Fraction (nominally 0..1) of ``peak_flops`` achieved at ``tokens_per_s``."""
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    if tokens_per_s < 0 or flops_per_token < 0:
        raise ValueError(f"tokens_per_s and flops_per_token must be >= 0, got "
                         f"{tokens_per_s}, {flops_per_token}")
    return tokens_per_s * flops_per_token / peak_flops

