"""Learning-rate schedules: warmup, cosine, warmup-stable-decay, constant."""

import math

import pytest

from lockstep.config.base import ConfigError
from lockstep.train.optim import AdamWConfig, LRScheduleConfig


def test_cosine_warmup_then_decay_to_floor():
    lr = LRScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1).build(peak_lr=1.0, total_steps=110)
    assert lr(1) == pytest.approx(0.1)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr(110) == pytest.approx(0.1)
    values = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_flat_then_linear():
    lr = LRScheduleConfig(kind="wsd", warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.0).build(
        peak_lr=2.0, total_steps=100)
    assert lr(5) == pytest.approx(2.0)
    assert lr(50) == lr(80) == pytest.approx(2.0)
    assert lr(90) == pytest.approx(1.0)
    assert lr(100) == pytest.approx(0.0)


def test_constant_and_tiny_runs():
    assert LRScheduleConfig(kind="constant", warmup_steps=0).build(peak_lr=3.0, total_steps=5)(4) == 3.0
    # warmup longer than the run is clipped so the last step is not stuck at a tiny lr
    lr = LRScheduleConfig(kind="cosine", warmup_steps=50).build(peak_lr=1.0, total_steps=3)
    assert lr(2) == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs, field", [({"kind": "linear"}, "lr_schedule.kind"),
                                           ({"warmup_steps": -1}, "lr_schedule.warmup_steps"),
                                           ({"min_lr_ratio": 2.0}, "lr_schedule.min_lr_ratio")])
def test_schedule_validation(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LRScheduleConfig(**kwargs).validate()


def test_negative_lr_is_rejected():
    with pytest.raises(ConfigError, match=r"optimizer.lr: must be > 0, got -0.1"):
        AdamWConfig(lr=-0.1).validate()
