"""Tensor parallel over the Qwen3.5 MoE hybrid (gloo, tp=2): Gated DeltaNet with the split
projections (``in_proj_qkv`` and the conv held whole, computing each rank's heads' rows), output-gated
attention, expert TP and the sigmoid-gated shared expert, against one process from the same weights.

Not a ``TESTED_LAYOUTS`` entry: a run's manifest names its parity test by family and degrees, and
the dense qwen3_5 entry ``tp=2 qwen3_5 (Gated DeltaNet, gated attention)`` already holds those.
Tolerances are the loss-parity ones (tests/parallel/test_loss_parity.py, whose launcher this
reuses): losses within 1e-5 over 5 fp32 steps, every saved parameter within 2e-4 after them.
"""

import pytest

from tests.parallel.test_loss_parity import _train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


def test_qwen35_moe_tp2_matches_one_process(tmp_path):
    from safetensors.torch import load_file

    one, one_dir = _train(tmp_path / "one", "debug-qwen35-moe", save_weights=True)
    two, two_dir = _train(tmp_path / "two", "debug-qwen35-moe", nproc=2, extra=["--parallel.tp", "2"],
                          save_weights=True)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4, 5]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    got, want = load_file(two_dir / "model.safetensors"), load_file(one_dir / "model.safetensors")
    assert got.keys() == want.keys()
    assert any(".shared_expert_gate." in k for k in want) and any(".in_proj_qkv." in k for k in want)
    worst = max(((got[k] - want[k]).abs().max().item(), k) for k in want)
    assert worst[0] <= 2e-4, worst
