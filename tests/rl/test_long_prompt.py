"""The ``rl-long-prompt`` recipe: one colocated RL step with prompts of several thousand tokens,
prefilled in chunks (engine.prefill_chunk)."""

from __future__ import annotations

from lockstep.cli_rl import resolve_rl_config
from lockstep.observe import read_metrics
from lockstep.rl.loop import run_rl


def test_rl_long_prompt_step(tmp_path):
    config, _ = resolve_rl_config(["--recipe", "rl-long-prompt", "--run-dir", str(tmp_path / "run"),
                                   "--workers.generators", "0", "--steps", "1", "--rollout.group-size", "2"])
    assert config.engine.prefill_chunk == 512 and config.model.max_seq_len == 4096
    result = run_rl(config)
    [record] = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "reward/mean" in r]
    prompt_tokens = record["trainer/tokens"] / 2 - record["response_length/mean"]
    assert 3000 < prompt_tokens < 4096 - 12, prompt_tokens  # several thousand tokens, within the context
    assert record["grad_norm"] > 0 and record["reward/std"] > 0  # echo: every group has reward variance
