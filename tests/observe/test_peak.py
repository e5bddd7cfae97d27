"""Peak matmul FLOPs: plausible measurement, per-machine cache, env override, thread restore."""

import json

import pytest
import torch

from lockstep.observe import peak


def _no_measure(*args, **kwargs):
    raise AssertionError("peak was measured again instead of read from the cache")


def test_measures_plausible_value_and_caches(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    rec = peak.peak_matmul_record(torch.float32, threads=1)
    assert torch.get_num_threads() == before
    assert rec["cached"] is False and rec["source"] == "measured"
    assert 1e8 < rec["value"] < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s on one core
    assert rec["dtype"] == "float32" and rec["threads"] == 1 and rec["size"] >= 256
    assert rec["measured_at"]

    path = tmp_path / "cache" / "peak_flops.json"
    cache = json.loads(path.read_text())
    assert len(cache) == 1 and "float32" in next(iter(cache))

    # The next runs measure again until MIN_SAMPLES measurements exist, keeping the best one.
    readings = iter([rec["value"] * 2, rec["value"] / 2])
    monkeypatch.setattr(peak, "_measure", lambda *a, **k: (next(readings), 2048))
    assert peak.MIN_SAMPLES == 3
    assert peak.peak_matmul_record(torch.float32, threads=1)["value"] == rec["value"] * 2
    third = peak.peak_matmul_record(torch.float32, threads=1)
    assert third["value"] == rec["value"] * 2 and third["samples"] == 3

    monkeypatch.setattr(peak, "_measure", _no_measure)
    again = peak.peak_matmul_record(torch.float32, threads=1)
    assert again["cached"] is True and again["value"] == rec["value"] * 2
    assert peak.peak_matmul_flops(torch.float32, threads=1) == rec["value"] * 2
    with pytest.raises(AssertionError):  # a different key is not a cache hit
        peak.peak_matmul_flops(torch.float32, threads=2)


def test_bf16_measures(monkeypatch):
    monkeypatch.setattr(peak, "_BUDGET_S", 0.2)
    assert peak.peak_matmul_flops(torch.bfloat16, threads=1) > 1e8


def test_default_threads_is_current(monkeypatch):
    seen = {}

    def fake(dtype, threads, size=peak.DEFAULT_SIZE):
        seen["threads"] = threads
        return 1e9, size

    monkeypatch.setattr(peak, "_measure", fake)
    rec = peak.peak_matmul_record(torch.float32)
    assert seen["threads"] == torch.get_num_threads() == rec["threads"]


def test_env_override(monkeypatch):
    monkeypatch.setattr(peak, "_measure", _no_measure)
    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "1.5e12")
    assert peak.peak_matmul_flops(torch.bfloat16) == 1.5e12
    rec = peak.peak_matmul_record(torch.bfloat16, threads=1)
    assert rec["source"] == "env" and rec["cached"] is False
    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="LOCKSTEP_PEAK_FLOPS"):
        peak.peak_matmul_flops(torch.bfloat16)


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "peak_flops.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    monkeypatch.setattr(peak, "_measure", lambda d, t, size=2048: (2e9, size))
    assert peak.peak_matmul_flops(torch.float32, threads=1) == 2e9
    assert len(json.loads(path.read_text())) == 1
    assert not list(path.parent.glob("*.tmp"))
