"""cp x pp in one process: what is refused by name (multi-process parity: tests/parallel/test_loss_parity.py,
layout "cp=2 x pp=2 qwen3 (tied)")."""

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.runtime import ParallelRuntime


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_and_mtp_models_are_refused_under_cp_x_pp(family):
    config = ParallelConfig(cp=2, pp=2)
    runtime = ParallelRuntime(0, 4, torch.device("cpu"), config.resolve(4), None, 0)
    model = build_model(model_config(family, "debug"), seed=0)
    with pytest.raises(ConfigError, match=r"parallel.cp: context parallel with pipeline parallel \(parallel.pp=2\) "
                                          r"runs dense models only: .*MoE balance / MTP losses"):
        runtime.parallelize(model, config)
    assert runtime.pipeline is None and runtime.context is None  # refused before any stage or group exists
