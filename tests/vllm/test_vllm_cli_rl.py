"""``lockstep generate --engine vllm`` and ``lockstep rl --workers.engine vllm``: the command-line and RL
ends of lockstep.vllm (the engine itself: test_vllm_engine.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.cli import main
from lockstep.cli_rl import resolve_rl_config
from lockstep.config.base import ConfigError
from lockstep.data.tokenizer import train_bpe
from lockstep.models.common.transformer import build_model
from lockstep.models.hf import save_hf
from lockstep.models.registry import model_config
from lockstep.observe import read_metrics

pytestmark = pytest.mark.xdist_group("vllm")  # one worker pays vLLM's import once

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 20


def _hf_dir(path: Path) -> Path:
    """A random llama3 debug model (weights large enough that greedy text varies) beside a small BPE."""
    tok = train_bpe([TEXT], 320, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    model = build_model(dataclasses.replace(model_config("llama3", "debug"), vocab_size=tok.vocab_size), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
    save_hf(model, path)
    return path


def test_generate_engine_vllm_prints_what_engine_lockstep_prints(tmp_path, capsys):
    path = _hf_dir(tmp_path)
    out = {}
    for engine in ("lockstep", "vllm"):
        assert main(["generate", "--checkpoint", str(path), "--prompt", "To be, or", "--max-new-tokens", "12",
                     "--engine", engine, "--json"]) == 0
        out[engine] = json.loads(capsys.readouterr().out)  # vLLM's own logging goes to stderr
    assert out["vllm"]["token_ids"] == out["lockstep"]["token_ids"]
    assert out["vllm"]["text"] == out["lockstep"]["text"] and out["vllm"]["text"]
    assert out["vllm"]["finish_reason"] == out["lockstep"]["finish_reason"]
    # fp32, same modules; vLLM's attention kernel sums in another order (measured <= 3e-6)
    torch.testing.assert_close(torch.tensor(out["vllm"]["logprobs"]), torch.tensor(out["lockstep"]["logprobs"]),
                               atol=1e-4, rtol=0)
    assert not torch.distributed.is_initialized()  # the CLI closed vLLM: this process is as before


@pytest.mark.slow
def test_rl_debug_with_vllm_generators_follows_every_new_weights_version(tmp_path):
    """Trainer + one generator process (torchrun, gloo); the generator's vLLM engine core runs in a
    process of its own and gets every weights version in place. Every step changes the weights
    (rl-debug's dense reward), so vLLM's log-probabilities agreeing with the trainer's scoring of the
    same tokens at every step shows each sync took effect (a stale copy is off by far more)."""
    run_dir = tmp_path / "run"
    argv = ["rl", "--recipe", "rl-debug", "--run-dir", str(run_dir), "--steps", "3", "--workers.engine", "vllm",
            "--output.no-progress"]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([sys.executable, *launcher, "-m", "lockstep.cli", *argv], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["rollout_version"] for r in records] == [0, 1, 2]  # on-policy: batch i from version i - 1
    assert all(r["grad_norm"] > 0 for r in records)  # the weights changed every step
    model_bytes = records[0]["weight_sync/bytes"]
    assert all(r["generator/weight_sync_bytes"] == model_bytes and r["generator/weight_sync_s"] > 0
               for r in records)
    # fp32 trainer vs vLLM running the same modules: attention summation order only (measured <= 1e-6)
    assert all(r["logprob_diff/max"] < 1e-4 for r in records), [r["logprob_diff/max"] for r in records]


@pytest.mark.parametrize(("flags", "message"), [
    (["--workers.engine", "sglang"], "workers.engine: must be one of"),
    (["--workers.engine", "vllm", "--workers.generators", "0"], "workers.engine: 'vllm' runs in generator processes"),
])
def test_bad_workers_engine_is_a_config_error_naming_the_field(flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rl_config(["--recipe", "rl-debug", *flags])
