"""Metrics sinks: every numeric scalar of every record reaches JSONL, TensorBoard and (offline) W&B;
a resumed run drops what the interrupted one wrote after its checkpoint; W&B stays optional."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lockstep.config.base import ConfigError
from lockstep.observe import read_metrics
from lockstep.run import RunLog, SinkOutputs, scalars


def _tb(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def test_scalars_keeps_numbers_only():
    record = {"step": 3, "loss": 1.5, "n": 2, "ok": True, "name": "x", "bad": None, "nan": float("nan")}
    assert scalars(record) == {"loss": 1.5, "n": 2.0}


def test_runlog_writes_jsonl_and_tensorboard_and_resume_truncates(tmp_path):
    with RunLog(tmp_path, SinkOutputs(), rank=0, main=True) as log:
        for step in (1, 2, 3):
            written = log.write({"step": step, "loss": torch.tensor(4.0 - step), "phase": "rl"})
            assert written["loss"] == 4.0 - step  # a tensor becomes a number before any sink sees it
    acc = _tb(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    # resumed from the step-2 checkpoint: step 3 is written again, the old step 3 is gone everywhere
    with RunLog(tmp_path, SinkOutputs(), rank=0, main=True, resume_step=2) as log:
        assert [r["step"] for r in log.kept] == [1, 2]
        log.write({"step": 3, "loss": 0.5})
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [3.0, 2.0, 0.5]
    assert [(e.step, e.value) for e in _tb(tmp_path).Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 0.5)]


def test_other_ranks_write_their_own_log_only(tmp_path):
    with RunLog(tmp_path, SinkOutputs(wandb=False), rank=3, main=False) as log:
        log.write({"step": 1, "loss": 1.0})
    assert read_metrics(tmp_path / "logs" / "rank3.jsonl") == [{"step": 1, "loss": 1.0}]
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()


class _FakeWandb(types.ModuleType):
    """The calls WandbSink makes, recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, values))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_sink_logs_offline_every_scalar(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    output = SinkOutputs(wandb=True, tensorboard=False, wandb_project="proj")
    output.validate("output")
    with RunLog(tmp_path, output, rank=0, main=True, recipe={"recipe": "debug"}) as log:
        log.write({"step": 1, "loss": 2.0, "note": "text"})
        log.write({"step": 2, "loss": 1.0, "val_loss": 1.5})
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["project"] == "proj"
    assert fake.inits[0]["dir"] == str(tmp_path) and fake.inits[0]["config"] == {"recipe": "debug"}
    assert fake.logged == [(1, {"loss": 2.0}), (2, {"loss": 1.0, "val_loss": 1.5})]
    assert fake.finished == 1


def test_wandb_asked_but_missing_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"output.wandb: .*pip install wandb"):
        SinkOutputs(wandb=True).validate("output")
    SinkOutputs(wandb=False).validate("output")  # not asked: nothing to import
