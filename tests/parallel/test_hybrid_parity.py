"""Gated DeltaNet hybrid (qwen3_5 MoE) under FSDP2 + expert parallelism (dp_shard=2, ep=2, gloo)
trains like one process: same loss per step within the loss-parity tolerance (1e-5, see
tests/parallel/test_loss_parity.py, whose launcher this reuses; measured here: <= 1e-6)."""

import pytest

from tests.parallel.test_loss_parity import _train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


def test_qwen35_moe_fsdp_ep_matches_one_process(tmp_path):
    one, _ = _train(tmp_path / "one", "debug-qwen35-moe")
    two, _ = _train(tmp_path / "two", "debug-qwen35-moe", nproc=2,
                    extra=["--parallel.dp-shard", "2", "--parallel.ep", "2"])
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4, 5]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
