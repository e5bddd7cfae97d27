"""The RL trainer on a pipeline (``parallel.pp``): the refusals that remain (each naming its field), the checks
of scored sequences the pipeline path shares with ``score_logprobs``, and ``lockstep rl --parallel.pp 2`` end to end.
The pipelined learners' equality with one process (pp 2, pp 2 with a tied head, pp x dp_shard, pp x HSDP, pp x tp,
pp x ep) and their bit-exact resharding sync run in tests/rl/test_rl_trainer_parallel.py's spawn (its ``pp*``
cases: one spawn for every trainer layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.config.base import ConfigError
from tests.rl.test_rl_loop import _cli, debug_config, step_records

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


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
