"""cp x pp in one process: what is refused by name (multi-process parity: tests/parallel/test_loss_parity.py,
layouts "cp=2 x pp=2 ...")."""

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.runtime import ParallelRuntime


def test_mtp_models_are_refused_under_cp_x_pp():
    config = ParallelConfig(cp=2, pp=2)
    runtime = ParallelRuntime(0, 4, torch.device("cpu"), config.resolve(4), None, 0)
    model = build_model(model_config("deepseek_v3", "debug"), seed=0)
    assert model.config.mtp_loss_weight > 0
    with pytest.raises(ConfigError, match=r"parallel.cp: context parallel with pipeline parallel \(parallel.pp=2\) "
                                          r"does not run DeepSeekV3Transformer's MTP heads .*model.mtp_loss_weight=0"):
        runtime.parallelize(model, config)
    assert runtime.pipeline is None and runtime.context is None  # refused before any stage or group exists
