"""FSDP2 (dp_shard=2, gloo) trains DeepSeek-V3.2 like one process: 5 fp32 steps of the
``debug-deepseek-v32`` recipe (indexer KL loss on), losses, the indexer's auxiliary losses and every
saved parameter compared. Runs through tests/parallel/test_loss_parity.py's batch launcher (the
``lockstep train`` CLI in torchrun); tolerances are that file's (reduction order moves fp32 losses by
~1e-7 per step, AdamW turns that into parameter differences up to ~1e-4)."""

from __future__ import annotations

import json

import pytest

from tests.parallel.test_loss_parity import _argv, _failure, _loss_records, _run_batch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]

RECIPE = "debug-deepseek-v32"


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
        kl = sorted(k for k in a if k.startswith("aux_loss/") and k.endswith("indexer/kl"))
        assert len(kl) == 4 and kl == sorted(k for k in b if k.startswith("aux_loss/") and k.endswith("indexer/kl"))
        assert all(abs(a[k] - b[k]) <= 1e-5 and a[k] > 0 for k in kl), (a, b)
    got, want = load_file(two_dir / "model.safetensors"), load_file(one_dir / "model.safetensors")
    assert got.keys() == want.keys() and any(".indexer.wq_b." in k for k in want)
    worst = max(((got[k] - want[k]).abs().max().item(), k) for k in want)
    assert worst[0] <= 2e-4, worst
    manifest = json.loads((two_dir / "manifest.json").read_text())
    assert manifest["parallel"]["world_size"] == 2
