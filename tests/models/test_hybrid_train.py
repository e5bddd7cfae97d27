"""Training smoke of the Gated DeltaNet hybrid recipes: `lockstep train --recipe debug-qwen35 /
debug-qwen3next` runs, losses are finite and fall, the manifest names the linear-attention kernel;
activation checkpointing keeps the losses bitwise."""

import dataclasses
import json
import math

import pytest

from lockstep.cli import resolve_config
from lockstep.parallel.checkpointing import ActivationCheckpointConfig
from lockstep.train.trainer import Trainer


def _config(tmp_path, recipe: str, steps: int = 3, name: str = "run"):
    cfg, _ = resolve_config(["--recipe", recipe, "--steps", str(steps), "--run-dir", str(tmp_path / name),
                             "--output.no-progress", "--output.sample-tokens", "0"])
    return cfg


@pytest.mark.parametrize("recipe", ["debug-qwen35", "debug-qwen3next"])
def test_recipe_trains(tmp_path, recipe):
    result = Trainer(_config(tmp_path, recipe)).fit()
    print(f"{recipe}: losses {result.losses}")
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert manifest["kernels"]["linear_attention"] == ["chunked_delta_rule(chunk_size=64)"]


def test_activation_checkpointing_keeps_losses_bitwise(tmp_path):
    base = Trainer(_config(tmp_path, "debug-qwen35-moe", steps=2, name="base")).fit()
    cfg = _config(tmp_path, "debug-qwen35-moe", steps=2, name="ac")
    cfg.training = dataclasses.replace(cfg.training, activation_checkpoint=ActivationCheckpointConfig(mode="full"))
    assert Trainer(cfg).fit().losses == base.losses
