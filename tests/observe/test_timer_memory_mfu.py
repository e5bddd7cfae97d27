"""StageTimer accumulation, memory probes and MFU arithmetic."""

import time

import pytest

from lockstep.observe import (
    StageTimer,
    current_rss_bytes,
    memory_metrics,
    mfu,
    peak_rss_bytes,
    tokens_per_second,
)


def test_timer_accumulates_and_resets():
    t = StageTimer()
    for _ in range(2):
        with t.stage("forward"):
            time.sleep(0.01)
    with t.stage("data"):
        pass
    out = t.pop()
    assert set(out) == {"time/forward", "time/data"}
    assert 0.02 <= out["time/forward"] < 0.5
    assert 0 <= out["time/data"] < out["time/forward"]
    assert t.pop() == {}


def test_timer_reentrant_same_name_counts_outer_span_once():
    t = StageTimer()
    start = time.perf_counter()
    with t.stage("step"):
        with t.stage("step"):
            time.sleep(0.01)
        with t.stage("inner"):
            time.sleep(0.01)
    wall = time.perf_counter() - start
    out = t.pop()
    assert 0.02 <= out["time/step"] <= wall  # double counting would exceed the wall time
    assert out["time/inner"] < out["time/step"]


def test_timer_sync_and_prefix():
    calls = []
    t = StageTimer(prefix="t_", sync=lambda: calls.append(1))
    with t.stage("x"):
        pass
    assert list(t.pop()) == ["t_x"] and len(calls) == 2


def test_memory():
    assert peak_rss_bytes() >= current_rss_bytes() > 10 * 2**20
    m = memory_metrics()
    assert m["mem/peak_rss_gib"] > 0


def test_mfu_arithmetic():
    assert tokens_per_second(1000, 2.0) == 500.0
    assert tokens_per_second(1000, 0.0) == 0.0
    assert mfu(1000.0, 6e9, 1.2e13) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)
