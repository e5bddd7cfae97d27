"""training.on_nonfinite in RL (issue 15). A NaN is put into the real gradients of one step (the
rl-debug policy's softmax saturates at a huge lr instead of blowing up, and NaN weights would stop the
sampler first); the learner must drop that update and the trainer apply the policy."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep.cli_rl import resolve_rl_config
from lockstep.observe import read_metrics
from lockstep.parallel.runtime import ParallelRuntime
from lockstep.rl.loop import run_rl
from lockstep.run import NonFiniteError

FLAGS = ["--recipe", "rl-debug", "--workers.generators", "0", "--steps", "4", "--task.eval-every", "0",
         "--output.no-progress"]


@pytest.fixture
def nan_at_step(monkeypatch):
    """Poison the gradients of the given (1-based) optimizer step with NaN, before they are clipped."""
    def arm(bad_step: int) -> None:
        original = ParallelRuntime.clip_gradients
        calls = {"n": 0}

        def clip_gradients(self, max_norm):
            calls["n"] += 1
            if calls["n"] == bad_step:
                grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
                grad.fill_(float("nan"))
            return original(self, max_norm)

        monkeypatch.setattr(ParallelRuntime, "clip_gradients", clip_gradients)
    return arm


def _run(tmp_path, *flags):
    config, _ = resolve_rl_config([*FLAGS, "--run-dir", str(tmp_path / "run"), *flags])
    return run_rl(config)


def _finite(path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(path).values() if t.is_floating_point())


def _steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_rl_stop_raises_naming_the_step_and_writes_no_weights(tmp_path, nan_at_step):
    nan_at_step(2)
    with pytest.raises(NonFiniteError, match=r"^step 2: non-finite .*on_nonfinite=stop"):
        _run(tmp_path)
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_rl_skip_step_drops_the_update_and_finishes(tmp_path, nan_at_step):
    nan_at_step(2)
    result = _run(tmp_path, "--training.on-nonfinite", "skip_step")
    steps = _steps(result.run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["nonfinite/skipped_steps"] for r in steps] == [0, 1, 1, 1]
    assert _finite(result.run_dir / "model.safetensors")


def test_rl_rollback_reloads_the_newest_checkpoint_and_finishes(tmp_path, nan_at_step):
    nan_at_step(3)
    result = _run(tmp_path, "--training.on-nonfinite", "rollback", "--checkpoint.every", "1")
    steps = _steps(result.run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r.get("nonfinite/rollback_to") for r in steps] == [None, None, 2, None]
    assert steps[-1]["nonfinite/rollbacks"] == 1
    assert _finite(result.run_dir / "model.safetensors")
    # after the rollback the weights are step 2's: checkpoint 3 holds exactly checkpoint 2's model
    two, three = ({k: v for shard in (result.run_dir / "checkpoints" / f"step-{s:08d}").glob("*.safetensors")
                   for k, v in load_file(shard).items()} for s in (2, 3))
    model = [k for k in two if k.startswith("model/")]
    assert model and all(torch.equal(two[k], three[k]) for k in model)
