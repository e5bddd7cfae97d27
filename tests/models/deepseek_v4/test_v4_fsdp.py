"""FSDP2 (dp_shard=2, gloo) trains DeepSeek-V4 like one process: 5 fp32 steps of the
``debug-deepseek-v4`` recipe, losses and every saved parameter compared. Same launcher and tolerances
as tests/models/deepseek_v32/test_v32_fsdp.py (reduction order moves fp32 losses by ~1e-7 per step,
AdamW turns that into parameter differences up to ~1e-4)."""

from __future__ import annotations

import pytest

from tests.parallel.test_loss_parity import _argv, _failure, _loss_records, _run_batch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]

RECIPE = "debug-deepseek-v4"


def _run(root, name, nproc, extra):
    root.mkdir(parents=True)
    _run_batch(root, nproc, [(name, _argv(root / name / "run", RECIPE, extra, True))])
    if not (root / name / "ok").exists():
        pytest.fail(f"{name} failed\n{_failure(root / name)}")
    return _loss_records(root / name / "run"), root / name / "run"


def test_fsdp2_world2_matches_one_process(tmp_path):
    from safetensors.torch import load_file

    one, one_dir = _run(tmp_path / "one", "one", 1, [])
    two, two_dir = _run(tmp_path / "two", "two", 2, ["--parallel.dp_shard", "2"])
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4, 5]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    got, want = load_file(two_dir / "model.safetensors"), load_file(one_dir / "model.safetensors")
    assert got.keys() == want.keys() and any(".attn_hc.fn" in k for k in want)
    worst = max(((got[k].float() - want[k].float()).abs().max().item(), k) for k in want)
    assert worst[0] <= 2e-4, worst
