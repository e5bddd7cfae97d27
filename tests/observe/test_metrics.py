"""MetricsWriter round trip: tensors, numpy scalars, NaN as null, crash-safe flushing."""

import math

import numpy as np
import torch

from lockstep.observe import MetricsWriter, read_metrics


def test_round_trip_with_tensors_and_nan(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write(step=1, loss=torch.tensor(2.5), lr=np.float32(0.5), tokens=np.int64(4096))
        w.write({"step": 2, "loss": float("nan")}, grad_norm=torch.tensor(float("inf")))
        w.write(step=3, loss=1.0, tag="val", hist=torch.tensor([1.0, 2.0]))
    assert w.closed
    recs = read_metrics(path)
    assert recs[0] == {"step": 1, "loss": 2.5, "lr": 0.5, "tokens": 4096}
    assert isinstance(recs[0]["tokens"], int)
    assert recs[1]["loss"] is None and recs[1]["grad_norm"] is None
    assert sorted(recs[1]["nonfinite"]) == ["grad_norm", "loss"]
    assert "nonfinite" not in recs[0]
    assert recs[2]["hist"] == [1.0, 2.0] and recs[2]["tag"] == "val"


def test_each_write_is_on_disk_before_close_and_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(path)
    w.write(step=1, loss=3.0)
    assert read_metrics(path) == [{"step": 1, "loss": 3.0}]  # flushed, not buffered
    w.close()
    with MetricsWriter(path) as w2:  # reopening appends
        w2.write(step=2, loss=2.0)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_truncated_last_line_is_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]


def test_nan_record_is_strict_json(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write(step=1, loss=math.nan)
    assert "NaN" not in path.read_text()
