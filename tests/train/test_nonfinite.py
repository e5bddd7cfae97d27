"""training.on_nonfinite (issue 15): `lockstep train --recipe debug --optimizer.lr 1e6` blows up at step 3
(grad norm NaN); before, the run went on, saved NaN checkpoints and NaN weights and exited 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep.cli import main
from lockstep.config.base import set_by_path
from lockstep.recipes import get_recipe
from lockstep.run import NonFiniteError
from lockstep.train.trainer import Trainer

QUIET = ["--output.no-progress", "--output.sample-tokens", "0", "--output.no-parity-check", "--validation.every", "0"]
BLOW_UP = ["train", "--recipe", "debug", "--steps", "6", "--optimizer.lr", "1e6", "--checkpoint.every", "2", *QUIET]


def _all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def _checkpoints(run_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for step_dir in sorted((run_dir / "checkpoints").glob("step-*")):
        tensors: dict[str, torch.Tensor] = {}
        for shard in step_dir.glob("*.safetensors"):
            tensors.update(load_file(shard))
        out[int(step_dir.name.split("-")[1])] = tensors
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_stop_is_the_default_exits_non_zero_and_saves_nothing_non_finite(tmp_path, capsys):
    assert main([*BLOW_UP, "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 3: non-finite grad_norm=nan" in err[0] and "on_nonfinite=stop" in err[0]
    checkpoints = _checkpoints(tmp_path)
    assert list(checkpoints) == [2] and _all_finite(checkpoints[2])  # the last finite one stays
    assert not (tmp_path / "model.safetensors").exists()


def test_skip_step_drops_the_updates_and_counts_them(tmp_path):
    assert main([*BLOW_UP, "--run-dir", str(tmp_path), "--training.on-nonfinite", "skip_step"]) == 0
    steps = [r for r in _records(tmp_path) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1]["nonfinite/skipped_steps"] == 4  # steps 3..6 all have a NaN gradient
    assert _all_finite(load_file(tmp_path / "model.safetensors"))
    checkpoints = _checkpoints(tmp_path)
    assert list(checkpoints) == [2, 4, 6] and all(_all_finite(c) for c in checkpoints.values())
    # a skipped step leaves the weights exactly as they were
    model = [k for k in checkpoints[4] if k.startswith("model/")]
    assert model and all(torch.equal(checkpoints[4][k], checkpoints[6][k]) for k in model)


def test_rollback_stops_after_max_rollbacks_when_every_retry_blows_up(tmp_path, capsys):
    assert main([*BLOW_UP, "--run-dir", str(tmp_path), "--training.on-nonfinite", "rollback",
                 "--training.max-rollbacks", "2"]) == 1
    assert "after 2 rollback(s) (training.max_rollbacks=2)" in capsys.readouterr().err
    assert list(_checkpoints(tmp_path)) == [2] and not (tmp_path / "model.safetensors").exists()
    assert [r["nonfinite/rollback_to"] for r in _records(tmp_path) if "nonfinite/rollback_to" in r] == [2, 2]


def test_rollback_without_a_checkpoint_stops_with_a_clear_error(tmp_path, capsys):
    args = [a for a in BLOW_UP if a not in ("--checkpoint.every", "2")]
    assert main([*args, "--run-dir", str(tmp_path), "--training.on-nonfinite", "rollback"]) == 1
    assert "no checkpoint to roll back to" in capsys.readouterr().err


def _config(run_dir: Path, **fields):
    config = get_recipe("debug").config()
    settings = {"steps": 6, "run_dir": str(run_dir), "checkpoint.every": 2, "validation.every": 0,
                "output.progress": False, "output.sample_tokens": 0, "output.parity_check": False,
                "output.tensorboard": False, **fields}
    for path, value in settings.items():
        config = set_by_path(config, path, value)
    return config


def test_rollback_reloads_the_last_checkpoint_and_goes_on_past_the_batch(tmp_path):
    """A NaN gradient injected once, at step 3: the run reloads step 2, redoes steps 3..6 on the next
    batches and finishes with finite weights."""
    trainer = Trainer(_config(tmp_path, **{"training.on_nonfinite": "rollback"}))
    param = next(trainer.model.parameters())
    calls = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 3 else grad

    param.register_hook(poison)
    result = trainer.fit()
    assert len(result.losses) == 6 and all(torch.isfinite(torch.tensor(result.losses)))
    records = _records(tmp_path)
    assert [r["nonfinite/rollback_to"] for r in records if "nonfinite/rollback_to" in r] == [2]
    assert [r for r in records if "loss" in r][-1]["nonfinite/rollbacks"] == 1
    # the loader went on: the redone step 3 saw a different batch from the poisoned one
    step3 = [r["loss"] for r in records if r.get("step") == 3 and "loss" in r]
    assert len(step3) == 2 and step3[0] != step3[1]
    assert _all_finite(load_file(tmp_path / "model.safetensors"))


def test_stop_in_process_raises_naming_the_step(tmp_path):
    trainer = Trainer(_config(tmp_path))
    next(trainer.model.parameters()).register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteError, match=r"^step 1: non-finite grad_norm="):
        trainer.fit()
    assert not (tmp_path / "model.safetensors").exists()


def test_a_non_finite_state_is_never_saved_and_pruning_keeps_the_last_finite_checkpoint(tmp_path):
    """keep=2: after saves at steps 2 and 4, NaN weights at steps 6 and 8 are refused (warning + record);
    steps 2 and 4 stay on disk, and the final weights are refused too."""
    from lockstep.run.directory import save_weights

    trainer = Trainer(_config(tmp_path, **{"checkpoint.keep": 2}))
    policy = trainer.checkpointing
    assert policy.save(2) and policy.save(4)
    policy.records(wait=True)
    weight = next(trainer.model.parameters())
    with torch.no_grad():
        weight[0, 0] = float("nan")
    for step in (6, 8):
        with pytest.warns(RuntimeWarning, match=f"checkpoint at step {step} not saved: non-finite"):
            assert not policy.save(step)
    refused = policy.records(wait=True)
    assert [r["checkpoint/refused_step"] for r in refused] == [6, 8]
    policy.close()
    checkpoints = _checkpoints(tmp_path)
    assert list(checkpoints) == [2, 4] and all(_all_finite(c) for c in checkpoints.values())
    with pytest.raises(NonFiniteError, match="model.safetensors not written: non-finite values in 1 tensor"):
        save_weights(dict(trainer.model.state_dict()), tmp_path / "model.safetensors", tied=False)
    assert not (tmp_path / "model.safetensors").exists()
