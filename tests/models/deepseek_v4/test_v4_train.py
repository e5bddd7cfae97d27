"""DeepSeek-V4 training: the debug recipe's loss falls; batch-invariant mode and tensor parallelism are
refused with a ConfigError naming the field and the op; forwards the family does not support refuse."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep import numerics
from lockstep.cli import resolve_config
from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.tp_blocks import check_tp_divides
from lockstep.train.trainer import Trainer


def test_debug_recipe_trains(tmp_path):
    cfg, _ = resolve_config(["--recipe", "debug-deepseek-v4", "--steps", "4", "--run-dir", str(tmp_path / "run"),
                             "--output.no-progress", "--output.sample-tokens", "0"])
    result = Trainer(cfg).fit()
    print(f"debug-deepseek-v4 losses {result.losses}")
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0] - 0.1


@pytest.fixture(scope="module")
def model():
    return build_model(model_config("deepseek_v4", "debug"))


def test_batch_invariant_mode_refused_naming_the_ops(model):
    tokens = torch.randint(0, 4096, (1, 9))
    with numerics.batch_invariant(), pytest.raises(ConfigError, match=r"^numerics.batch_invariant: .*"
                                                   r"'compressed_attention.eager'.*'hyper_connections.sinkhorn'"):
        model(tokens)


def test_tensor_parallel_refused(model):
    with pytest.raises(ConfigError, match=r"^parallel.tp: DeepSeek-V4's compressed attention \(layers.0.attention"):
        check_tp_divides(model, 2)


def test_unsupported_forwards_refused(model):
    tokens = torch.randint(0, 4096, (1, 6))
    with pytest.raises(ConfigError, match="^positions: a cached deepseek_v4 forward"):
        model.trunk(tokens, cache=object())
    with pytest.raises(ConfigError, match="no vision input"):
        model.trunk(tokens, visual=object())
    with pytest.raises(ConfigError, match="^positions: "):
        model.trunk(tokens, positions=torch.arange(3, 9)[None])
    assert model(tokens, positions=torch.arange(6)[None]).shape == (1, 6, 4096)


def test_batch_invariant_run_configs_refuse_the_family():
    """Trainer and RL configs refuse batch-invariant mode at validation, before any work, naming the ops."""
    import dataclasses

    from lockstep.recipes.registry import get_recipe
    from lockstep.rl.config import RLConfig

    cfg = get_recipe("debug-deepseek-v4").config()
    cfg.validate()
    on = dataclasses.replace(cfg, numerics=dataclasses.replace(cfg.numerics, batch_invariant=True))
    with pytest.raises(ConfigError, match=r"^numerics.batch_invariant: not supported by deepseek_v4 .*"
                                          r"'kv_compressor.indexer_topk'"):
        on.validate()
    with pytest.raises(ConfigError, match=r"^numerics.batch_invariant: not supported by deepseek_v4"):
        RLConfig(model=cfg.model, numerics=on.numerics).validate()
