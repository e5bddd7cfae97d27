"""The background checkpoint writer's priority: the trainer's by default, SCHED_IDLE on request
(lockstep/checkpoint/background.py); either way it saves."""

import os

import pytest
import torch

from lockstep.checkpoint import Checkpointer, LocalStorage, Slot


@pytest.mark.parametrize("choice,policy", [(None, os.SCHED_OTHER), ("idle", os.SCHED_IDLE)])
def test_writer_priority_and_it_still_saves(tmp_path, monkeypatch, choice, policy):
    if choice is None:
        monkeypatch.delenv("LOCKSTEP_CKPT_WRITER_PRIORITY", raising=False)
    else:
        monkeypatch.setenv("LOCKSTEP_CKPT_WRITER_PRIORITY", choice)  # the spawned writer inherits it
    ck = Checkpointer(LocalStorage(tmp_path), mode="process")
    try:
        w = torch.arange(12.0)
        ck.save(1, {"model/w": Slot.of(w)}, {}, {})
        (stats,) = ck.wait()  # the writer has run writer_main, priority applied first
        assert stats.error is None
        assert os.sched_getscheduler(ck.writer_pid) == policy
        assert os.sched_getscheduler(os.getpid()) == os.SCHED_OTHER  # the trainer keeps its priority
    finally:
        ck.close()
    target = torch.zeros(12)
    Checkpointer(LocalStorage(tmp_path), mode="sync").load({"model/w": Slot.of(target)})
    assert torch.equal(target, w)


def test_an_unknown_priority_names_the_variable(monkeypatch):
    from lockstep.checkpoint.background import lower_priority

    monkeypatch.setenv("LOCKSTEP_CKPT_WRITER_PRIORITY", "low")
    with pytest.raises(ValueError, match="LOCKSTEP_CKPT_WRITER_PRIORITY: must be one of normal, idle"):
        lower_priority()
