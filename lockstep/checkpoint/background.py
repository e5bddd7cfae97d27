"""How the background checkpoint writer shares the CPU with training: it runs at idle priority.

A save's background work (sha256 of every shard, the write, fsync) is a fixed amount of CPU per
save; run at normal priority it competes with the training ranks for every core, and with a save
every step on a small host it shows up as slower steps. At idle priority (Linux ``SCHED_IDLE``;
elsewhere the lowest ``nice``) the writer gets the cycles training leaves unused - collectives'
waits, data loading, the optimizer's memory-bound phases - and yields the moment a rank wants the
core back. It still finishes: a save waits for the previous one (``Checkpointer.save``), so a
starved writer shows up as ``checkpoint/waited_ms``, never as a lost checkpoint. Torch-free: the
writer process imports it.
"""

from __future__ import annotations

import os


#: ``normal`` leaves the writer at the trainer's priority (for A/B measurements: benchmarks/checkpoint.py)
PRIORITY_ENV = "LOCKSTEP_CKPT_WRITER_PRIORITY"


def lower_priority() -> str:
    """Move this process to idle scheduling priority; returns what was applied (for logs/tests)."""
    if os.environ.get(PRIORITY_ENV, "idle") == "normal":
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
