"""The background checkpoint writer runs at idle priority, so it takes only the CPU training leaves."""

import os
import time

import torch

from lockstep.checkpoint import Checkpointer, LocalStorage, Slot


def test_writer_process_runs_at_idle_priority_and_still_saves(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_CKPT_WRITER_PRIORITY", raising=False)
    ck = Checkpointer(LocalStorage(tmp_path), mode="process")
    try:
        deadline = time.monotonic() + 60
        while os.sched_getscheduler(ck.writer_pid) != os.SCHED_IDLE:  # set once the spawned writer is up
            assert time.monotonic() < deadline, "the writer never switched to SCHED_IDLE"
            time.sleep(0.05)
        assert os.sched_getscheduler(os.getpid()) != os.SCHED_IDLE  # the trainer keeps its priority
        w = torch.arange(12.0)
        ck.save(1, {"model/w": Slot.of(w)}, {}, {})
        (stats,) = ck.wait()
        assert stats.error is None
    finally:
        ck.close()
    target = torch.zeros(12)
    Checkpointer(LocalStorage(tmp_path), mode="sync").load({"model/w": Slot.of(target)})
    assert torch.equal(target, w)
