"""The RL trainer on a pipeline (``parallel.pp``, alone, with ``dp_shard``, ``tp`` and ``ep``): the SFT warm-up and the learner's
steps on fixed episodes equal one process's within fp32 rounding, with the policy loss on the schedule's last stage
and the KL reference forward-only through a pipeline of its own; each weights version reaches one-process and TP-2
generators bit-exactly through the resharding sync (every stage's ranks send their own layers). One spawn of 4
processes computes every case once (the helpers are tests/rl/test_rl_trainer_parallel.py's); the CLI runs end to
end with a pipelined trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.config.base import ConfigError
from tests.rl.test_rl_loop import _cli, debug_config, step_records
from tests.rl.test_rl_trainer_parallel import _case, _one_process

#: name -> (family, parallel config fields, trainer ranks, generators: (kind, ranks) each). qwen3_moe's debug
#: flavour ties its head to the embedding: the first and last stage share it (their gradients summed)
CASES = {
    "pp2": ("llama3", {"pp": 2, "dp_shard": 1}, [0, 1], [("whole", [2]), ("tp", [2, 3])]),
    "pp2_moe": ("qwen3_moe", {"pp": 2, "dp_shard": 1}, [0, 1], [("whole", [2])]),
    "pp2xdp2": ("llama3", {"pp": 2, "dp_shard": 2}, [0, 1, 2, 3], []),
    "pp2xhsdp2": ("llama3", {"pp": 2, "dp_replicate": 2, "dp_shard": 1}, [0, 1, 2, 3], []),  # HSDP per stage
    # each stage tensor-parallel: the last stage's vocabulary-sharded logits gathered before scoring
    "pp2xtp2": ("llama3", {"pp": 2, "tp": 2, "dp_shard": 1}, [0, 1, 2, 3], []),
    # each stage's experts split over ep (outside FSDP), the shared embedding of a tied head
    "pp2xep2": ("qwen3_moe", {"pp": 2, "ep": 2, "dp_shard": 2}, [0, 1, 2, 3], []),
}
STEPS = 2

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


def _worker(rank, world, init_file, out_dir):
    import datetime

    import torch.distributed as dist

    from lockstep.parallel.launch import finish

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    groups = {(2, 3): dist.new_group([2, 3])}
    sync_groups = [dist.new_group(list(range(world))) for _ in range(2)]
    results = {}
    for name in CASES:
        results[name] = _case(rank, world, Path(out_dir), name, groups, sync_groups, cases=CASES)
        dist.barrier()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    finish()


@pytest.fixture
def pipeline_trainer(computed_once):
    import torch.multiprocessing as mp

    def run(d):
        mp.spawn(_worker, args=(4, str(d / "init"), str(d)), nprocs=4, join=True)

    out = computed_once("rl trainer pp spawn world 4", run)
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(4)}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_trainer_steps_match_one_process_and_sync_bitwise(pipeline_trainer, tmp_path_factory, name):
    """SFT losses, RL losses, metrics, grad norms and final weights of the pipelined trainer vs one process on the
    same episodes (ratio_to current, a KL term: the reference scored through its own forward-only pipeline).
    Tolerance 1e-4: the pipeline splits each micro-batch into the schedule's micro-batches and sums their losses
    (and, with dp, FSDP averages two shares' gradients), and its head runs every position rather than the response
    rows: fp32 summation order, ~1e-7 relative per op; a wrong normaliser, a missed stage's gradient, an embedding
    copy not summed or a reference not scored would be O(1) off. Every generator rank holds, after each version,
    exactly the trainer's weights (``torch.equal`` per local shard)."""
    family, fields, _, generators = CASES[name]
    want_sft, want_steps, want_final = _one_process(tmp_path_factory.getbasetemp() / "one-process", family)
    res = pipeline_trainer
    got = res[0][name]
    assert len(want_sft) == 2 and got["sft"] == pytest.approx(want_sft, rel=1e-4), (name, want_sft, got["sft"])
    # the KL metric is each data-parallel share's token mean weighted by its sequences (as test_rl_trainer_parallel)
    keys = ["loss", "grad_norm", "loss/pg_loss"] + (["loss/kl"] if fields.get("dp_shard", 1) == 1
                                                     and fields.get("dp_replicate", 1) == 1 else [])
    for a, b in zip(want_steps, got["losses"]):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, key, a, b)
    assert got["losses"][1]["grad_norm"] > 0 and got["losses"][1]["loss/kl"] > 0  # the weights moved
    final = got["final"]
    assert final.keys() == want_final.keys()
    assert max(float((final[k] - want_final[k]).abs().max()) for k in want_final) < 1e-4
    for kind, ranks in generators:
        for rank in ranks:
            for step in range(1, STEPS + 1):
                assert res[rank][name][f"{kind}{ranks}:v{step}"] == [], (name, kind, rank, step)


@pytest.mark.parametrize("flags, message", [
    (["--parallel.pp", "2", "--parallel.pp-microbatches", "3"], "parallel.pp_microbatches: each learner micro-batch"),
    (["--parallel.pp", "2", "--sft.steps", "1", "--sft.batch-size", "3"], "sft.batch_size: the SFT warm-up's batch"),
    (["--parallel.pp", "2", "--training.mode", "graph"], "training.mode: graph mode does not capture a pipeline"),
    (["--parallel.pp", "3"], "parallel.pp: 2 layers cannot be split into 3 pipeline stages"),
    (["--parallel.pp", "2", "--workers.generators", "0"], "parallel.pp: colocated generation"),
    (["--recipe", "rl-qwen3-vl-shapes", "--parallel.pp", "2", "--workers.generators", "1"],
     "parallel.pp: model family 'qwen3_vl' has a vision tower"),
])
def test_pipeline_trainer_refusals_name_the_field(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        debug_config(tmp_path, *flags)


@pytest.mark.parametrize("sequences, prompts, temperature, message", [
    ([[1, 2, 3]], [0], 1.0, r"prompt_lengths\[0\]: 0 is outside \[1, 3\]"),
    ([[1, 2, 300]], [1], 1.0, r"sequences\[0\] has token ids outside the vocabulary \[0, 256\)"),
    ([[1, 2, 3]], [1], [1.0, 1.0], "temperature: 2 values for 1 sequences"),
    ([[1, 2, 3]], [1], 0.0, "temperature: must be > 0"),
])
def test_scored_sequences_are_checked_with_the_field_named(sequences, prompts, temperature, message):
    """What ``score_logprobs`` and a pipeline's ``PolicyObjective.pipeline_batch`` both check first."""
    from lockstep.rl.scoring import check_sequences

    with pytest.raises(ConfigError, match=message):
        check_sequences(sequences, prompts, temperature, 256)
    assert check_sequences([torch.tensor([4, 5])], [1], 0.7, 256) == ([[4, 5]], [1], [0.7])


def test_rl_pp2_trainer_cli_end_to_end(tmp_path):
    """Trainer ranks 0-1 (pipeline stages 0 and 1) + a one-process generator (rank 2), batch-invariant, with a KL
    term (the frozen reference as a forward-only pipeline) and a checkpoint: the loop runs, every version reaches the
    generator by the resharding sync (each stage's rank sends its own layers), and the trainer's log-probabilities
    (the last stage's, its head over every position) equal the generator's bitwise every step."""
    _cli(tmp_path, "--steps", "2", "--parallel.pp", "2", "--loss.kl-coef", "0.05", "--checkpoint.every", "2",
         "--numerics.batch-invariant", timeout=400)
    run_dir = Path(tmp_path / "run")
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [1, 2] and [r["rollout_version"] for r in records] == [0, 1]
    assert [r["logprob_diff/max"] for r in records] == [0.0, 0.0]
    assert records[1]["grad_norm"] > 0 and records[1]["loss/kl"] > 0
    full = records[0]["weight_sync/bytes_all_ranks"]
    # each stage's rank holds its layers only and sends only those
    assert 0 < records[0]["weight_sync/bytes"] < full == records[0]["generator/weight_sync_bytes"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["workers"]["trainer_layout"]["pp"] == 2 and manifest["workers"]["generator_ranks"] == [2]
    assert (run_dir / "checkpoints" / "step-00000002").is_dir() and (run_dir / "model.safetensors").is_file()
