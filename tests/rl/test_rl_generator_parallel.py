"""Generator groups in ``lockstep rl`` (``workers.generator_parallel``) and the resharding weight sync in
the loop: config checks (one process, cheap) and end-to-end runs, batch-invariant: a TP-2 trainer with a
one-process generator and with a TP-2 generator group, a one-process trainer with a TP-2 group (unlike
degrees: the smaller one's sums split, lockstep.rl.tp_split), an EP-2 generator group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.config.base import ConfigError
from tests.rl.test_rl_loop import _cli, debug_config, step_records


def test_world_size_counts_each_generator_group(tmp_path):
    config = debug_config(tmp_path, "--workers.generators", "2", "--workers.generator-parallel.tp", "2",
                          "--parallel.dp-shard", "2")
    assert config.world_size == 2 + 2 * 2
    assert config.workers.resolved_weight_sync(config.trainer_world_size) == "reshard"
    one = debug_config(tmp_path)
    assert one.world_size == 2 and one.workers.resolved_weight_sync(1) == "gather"  # the one-process path as before
    # tp and ep together, on both sides: a generator group of ep rows of tp ranks; an HSDP + EP trainer
    both = debug_config(tmp_path, "--workers.generator-parallel.tp", "2", "--workers.generator-parallel.ep", "2",
                        "--parallel.tp", "2", "--parallel.ep", "2", "--parallel.dp-shard", "2")
    assert both.trainer_world_size == 4 and both.world_size == 4 + 4
    hsdp = debug_config(tmp_path, "--parallel.dp-replicate", "2", "--parallel.dp-shard", "2", "--parallel.ep", "2")
    assert hsdp.trainer_world_size == 4 and hsdp.trainer_dp == 4


@pytest.mark.parametrize("flags, message", [
    (["--workers.generator-parallel.tp", "0"], "workers.generator_parallel.tp: must be an integer >= 1"),
    (["--workers.generator-parallel.tp", "2", "--workers.generators", "0"], "workers.generator_parallel: a generator "
                                                                            "group of 2 processes needs generator"),
    (["--workers.generator-parallel.tp", "2", "--workers.weight-sync", "gather"], "workers.weight_sync: 'gather'"),
    (["--workers.weight-sync", "bcast"], "workers.weight_sync: must be one of"),
    # experts FSDP-sharded on their expert dim (ep < dp_shard): a shard of a shard, which the sync does not read
    (["--parallel.dp-shard", "4", "--parallel.ep", "2"], "parallel.ep: .*ep < dp_shard.*got ep=2, dp_shard=4"),
    (["--parallel.dp-shard", "2", "--liveness.on-generator-loss", "continue"], "liveness.on_generator_loss: "
                                                                               "'continue' drops"),
])
def test_generator_layout_errors_name_the_field(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        debug_config(tmp_path, *flags)


@pytest.mark.parametrize("trainer_tp, generator_tp, family, bi, split, note", [
    (1, 2, "llama3", True, (2, 1), "the trainer's row-parallel sums are split 2 ways"),
    (2, 1, "llama3", True, (1, 2), "the generator's row-parallel sums are split 2 ways"),
    (2, 8, "llama3", True, (4, 1), "the trainer's row-parallel sums are split 4 ways"),
    (2, 2, "llama3", True, (1, 1), None),  # the same degree forms the same sums
    (1, 2, "llama3", False, (1, 1), None),  # outside the mode: no slower kernel
    (1, 3, "llama3", True, (1, 1), "not split.*3/1, not a power of two"),
    (2, 3, "llama3", True, (1, 1), "not split.*3/2, not a power of two"),
    (1, 2, "qwen3_moe", True, (1, 1), "not split.*off by rounding.*GroupedQueryAttention \\+ MoE"),
])
def test_tp_split_goes_to_the_smaller_degree_in_batch_invariant_mode(tmp_path, trainer_tp, generator_tp, family,
                                                                     bi, split, note):
    import dataclasses
    import re

    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.registry import model_config
    from lockstep.rl.tp_split import plan_tp_split

    config = debug_config(tmp_path, *(["--numerics.batch-invariant"] if bi else []))
    config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, tp=trainer_tp),
        workers=dataclasses.replace(config.workers, generator_parallel=dataclasses.replace(
            config.workers.generator_parallel, tp=generator_tp)))
    plan = plan_tp_split(config, build_meta_model(model_config(family, "debug")))
    assert (plan.trainer, plan.generator) == split
    assert (plan.note is None) if note is None else re.search(note, plan.note), plan.note


#: a torchrun worker: the rl-debug recipe with its llama3 replaced by the qwen3_moe debug model (8 experts, top-2)
_MOE_RUN = """
import dataclasses, sys
from lockstep.cli_rl import resolve_rl_config
from lockstep.models.registry import model_config
from lockstep.parallel.launch import finish
from lockstep.rl.loop import run_rl
config, _ = resolve_rl_config(sys.argv[1:])
run_rl(dataclasses.replace(config, model=model_config("qwen3_moe", "debug")))
finish(0)
"""


@pytest.mark.slow
def test_rl_ep2_generator_batch_invariant_logprobs_equal_the_trainers(tmp_path):
    """Trainer rank 0 (one process) + an expert-parallel generator of two processes (ranks 1-2, 4 experts
    each) on a qwen3_moe debug model, batch-invariant: the generator's log-probabilities equal the
    trainer's bitwise every step. The layouts differ, but the reduction order does not: each routed
    expert's rows are computed whole on one rank by the same batch-invariant kernels, and with top-2
    routing the one all-reduce adds the two experts' shares (``a + b``: the order one process adds them
    in; see docs/numerics.md)."""
    script = tmp_path / "moe_rl.py"
    script.write_text(_MOE_RUN)
    argv = ["--recipe", "rl-debug", "--run-dir", str(tmp_path / "run"), "--steps", "2", "--numerics.batch-invariant",
            "--workers.generator-parallel.ep", "2", "--output.no-save-weights"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           str(script), *argv], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and [r["rollout_version"] for r in records] == [0, 1]
    assert [r["logprob_diff/max"] for r in records] == [0.0, 0.0]
    # each rank holds half of the routed experts: the head receives less than the group holds
    assert 0 < records[0]["generator/weight_sync_bytes"] < records[0]["generator/weight_sync_group_bytes"]


@pytest.mark.slow
def test_rl_tp2_trainer_with_one_process_generator(tmp_path):
    """Trainer ranks 0-1 (tensor-parallel, sequence parallel, loss through the gathered vocabulary) + a
    one-process generator (rank 2), batch-invariant, with a KL term (the frozen reference placed like the
    policy) and a checkpoint: the loop runs, every version reaches the generator by the resharding sync (each
    trainer rank sends its own shards), and the generator, its row-parallel sums split 2 ways as TP 2 sums
    them (lockstep.rl.tp_split; without the split 9.5e-7 off), gives the trainer's log-probabilities bitwise."""
    proc = _cli(tmp_path, "--steps", "2", "--parallel.tp", "2", "--loss.kl-coef", "0.05", "--checkpoint.every",
                "2", "--numerics.batch-invariant", timeout=400)
    run_dir = Path(tmp_path / "run")
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [1, 2] and [r["rollout_version"] for r in records] == [0, 1]
    assert [r["logprob_diff/max"] for r in records] == [0.0, 0.0]
    assert "the generator's row-parallel sums are split 2 ways" in proc.stdout
    assert records[1]["grad_norm"] > 0 and records[1]["loss/kl"] > 0
    full = records[0]["weight_sync/bytes_all_ranks"]
    # each trainer rank holds half of the sharded weights and sends only what it holds
    assert 0 < records[0]["weight_sync/bytes"] < full == records[0]["generator/weight_sync_bytes"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["workers"]["trainer_layout"]["tp"] == 2 and manifest["workers"]["generator_ranks"] == [2]
    assert manifest["numerics"]["tp_split"] == {**manifest["numerics"]["tp_split"], "trainer": 1, "generator": 2}
    assert (run_dir / "checkpoints" / "step-00000002").is_dir() and (run_dir / "model.safetensors").is_file()


@pytest.mark.slow
def test_rl_one_process_trainer_tp2_generator_batch_invariant_logprobs_equal(tmp_path):
    """Trainer rank 0 (one process) + a TP-2 generator group (ranks 1-2), batch-invariant: the trainer's
    row-parallel sums split 2 ways (lockstep.rl.tp_split) form the TP-2 group's sums, so the generator's
    log-probabilities equal the trainer's bitwise every step (9.5e-7 off without the split)."""
    proc = _cli(tmp_path, "--steps", "2", "--workers.generator-parallel.tp", "2", "--numerics.batch-invariant",
                "--output.no-save-weights", timeout=400)
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and [r["rollout_version"] for r in records] == [0, 1]
    assert [r["logprob_diff/max"] for r in records] == [0.0, 0.0]
    assert records[1]["grad_norm"] > 0  # the second version differs from the first: its sync is checked too
    assert "the trainer's row-parallel sums are split 2 ways" in proc.stdout
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["numerics"]["tp_split"] == {**manifest["numerics"]["tp_split"], "trainer": 2, "generator": 1}


@pytest.mark.slow
def test_rl_tp2_trainer_tp2_generator_batch_invariant_logprobs_equal(tmp_path):
    """Trainer ranks 0-1 (TP 2) + a TP-2 generator group (ranks 2-3), batch-invariant: the loop runs, every
    version reaches both generator ranks by the resharding sync, and the generator's log-probabilities equal
    the trainer's bitwise every step. The same TP degree on both sides fixes the reduction order (each
    row-parallel layer's two partials summed in rank order, the head's logits whole before the log-softmax;
    docs/numerics.md), and the synced weights are the trainer's bit for bit."""
    _cli(tmp_path, "--steps", "2", "--parallel.tp", "2", "--workers.generator-parallel.tp", "2",
         "--numerics.batch-invariant", "--output.no-save-weights", timeout=400)
    run_dir = tmp_path / "run"
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [1, 2] and [r["rollout_version"] for r in records] == [0, 1]
    assert all(r["generator/rank"] == 2 for r in records)  # the group's head delivers the rollouts
    assert [r["logprob_diff/max"] for r in records] == [0.0, 0.0]
    assert records[1]["grad_norm"] > 0
    full = records[0]["weight_sync/bytes_all_ranks"]
    assert 0 < records[0]["weight_sync/bytes"] < full  # trainer rank 0 sends only its own shards
    # each generator rank holds half of the sharded weights: the head receives less than the whole group
    assert 0 < records[0]["generator/weight_sync_bytes"] < records[0]["generator/weight_sync_group_bytes"] == full
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["workers"]["generator_parallel"]["tp"] == 2 and manifest["workers"]["generator_ranks"] == [2]


@pytest.mark.slow
def test_rl_tp2_x_ep2_trainer_with_ep2_generator_cli(tmp_path):
    """``lockstep rl --recipe rl-debug-moe --parallel.tp 2 --parallel.ep 2``: trainer ranks 0-3 (two ep ranks of
    four experts each, every expert's hidden dim split over two tp ranks; attention TP, FSDP over the two data
    ranks) + an expert-parallel generator group (ranks 4-5), two steps: the loop runs end to end and every
    version reaches both generator ranks by the resharding sync (each trainer rank sending only what it
    holds). Log-probabilities agree to fp32 rounding only: expert TP sums each expert's output over two hidden
    halves, the generator computes it whole (docs/numerics.md); 1e-4 says the synced weights are the trainer's
    (one wrong expert or head moves them by O(1))."""
    _cli(tmp_path, "--recipe", "rl-debug-moe", "--steps", "2", "--parallel.tp", "2", "--parallel.ep", "2",
         "--parallel.dp-shard", "2", "--workers.generator-parallel.ep", "2", "--output.no-save-weights", timeout=500)
    run_dir = tmp_path / "run"
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [1, 2] and [r["rollout_version"] for r in records] == [0, 1]
    assert all(r["generator/rank"] == 4 for r in records)
    assert all(r["logprob_diff/max"] < 1e-4 for r in records), [r["logprob_diff/max"] for r in records]
    assert records[1]["grad_norm"] > 0
    full = records[0]["weight_sync/bytes_all_ranks"]
    assert 0 < records[0]["weight_sync/bytes"] < full / 2  # trainer rank 0 holds about a quarter of the model
    assert 0 < records[0]["generator/weight_sync_bytes"] < records[0]["generator/weight_sync_group_bytes"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["workers"]["trainer_layout"] == {**manifest["workers"]["trainer_layout"], "tp": 2, "ep": 2}
    assert manifest["workers"]["generator_parallel"]["ep"] == 2 and manifest["workers"]["generator_ranks"] == [4]
