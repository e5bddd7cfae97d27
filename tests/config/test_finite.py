"""Non-finite float config values are refused up front, naming the field (issue 15)."""

from __future__ import annotations

import math

import pytest

from lockstep.cli import main
from lockstep.config.base import ConfigError
from lockstep.generate import SamplingParams
from lockstep.recipes import get_recipe


@pytest.mark.parametrize("flag,value,field", [
    ("--optimizer.lr", "inf", "optimizer.lr"),
    ("--optimizer.lr", "nan", "optimizer.lr"),
    ("--optimizer.beta2", "-inf", "optimizer.beta2"),
    ("--lr-schedule.min-lr-ratio", "nan", "lr_schedule.min_lr_ratio"),
])
def test_train_refuses_non_finite_floats_naming_the_field(flag, value, field, capsys):
    assert main(["train", "--recipe", "debug", "--steps", "1", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{field}: must be a finite number, got {float(value)!r}" in err


def test_rl_refuses_an_infinite_sampling_temperature(capsys):
    assert main(["rl", "--recipe", "rl-debug", "--rollout.sampling.temperature", "inf"]) == 2
    assert "rollout.sampling.temperature: must be a finite number, got inf" in capsys.readouterr().err


def test_sampling_params_refuse_inf_temperature():
    with pytest.raises(ConfigError, match=r"sampling\.temperature: must be a finite number, got inf"):
        SamplingParams(temperature=math.inf).validate("sampling")


def test_max_grad_norm_opts_in_to_inf_but_never_nan():
    config = get_recipe("debug").config()
    config.replace(training=config.training.replace(max_grad_norm=math.inf)).validate()  # inf: no clipping
    with pytest.raises(ConfigError, match=r"training\.max_grad_norm"):
        config.replace(training=config.training.replace(max_grad_norm=math.nan)).validate()
