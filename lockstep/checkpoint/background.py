"""The background checkpoint writer's CPU priority: normal by default, idle on request.

A save's background work (sha256 of every shard, the write, fsync) is a fixed amount of CPU per
save. At idle priority (Linux ``SCHED_IDLE``, elsewhere the lowest ``nice``) the writer would take
only the cycles training leaves unused and yield the moment a rank wants its core back. Measured
on the shared 2-vCPU host of docs/benchmarks.md (other jobs keeping it saturated), idle priority
made things worse: the starved writer finished late and the next save waited for it (a save every
step: 1.58x the step time without saves, against 1.26x at normal priority, same benchmark). So the
default is normal priority; ``LOCKSTEP_CKPT_WRITER_PRIORITY=idle`` opts in where the trainer has
the host to itself. Torch-free: the writer process imports it.
"""

from __future__ import annotations

import os

PRIORITY_ENV = "LOCKSTEP_CKPT_WRITER_PRIORITY"
CHOICES = ("normal", "idle")


def lower_priority() -> str:
    """Apply ``$LOCKSTEP_CKPT_WRITER_PRIORITY`` to this process; returns what was applied."""
    choice = os.environ.get(PRIORITY_ENV, "normal")
    if choice not in CHOICES:
        raise ValueError(f"{PRIORITY_ENV}: must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "normal":
        return "unchanged"
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError:  # a sandbox that forbids it: fall back to nice
            pass
    try:
        os.nice(19 - os.nice(0))
        return "nice 19"
    except OSError:
        return "unchanged"
