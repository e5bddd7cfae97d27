"""Batch-invariant mode is CPU-only: TrainerConfig and RLConfig refuse ``numerics.batch_invariant``
with ``training.device`` resolving to CUDA at validation, naming both fields (CUDA mocked)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.recipes import get_recipe

RECIPES = ["debug", "rl-debug"]  # a TrainerConfig, an RLConfig


def _config(recipe: str, device: str, batch_invariant: bool):
    cfg = get_recipe(recipe).config()
    cfg.training = dataclasses.replace(cfg.training, device=device)
    cfg.numerics = dataclasses.replace(cfg.numerics, batch_invariant=batch_invariant)
    return cfg


def _cuda(monkeypatch, available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if available else 0)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_batch_invariant_on_cuda_is_refused_naming_both_fields(monkeypatch, recipe, device):
    _cuda(monkeypatch, True)
    cfg = _config(recipe, device, batch_invariant=True)
    with pytest.raises(ConfigError, match=rf"^numerics\.batch_invariant: batch-invariant mode is CPU-only .* "
                                          rf"but training\.device='{device}' resolves to cuda; set "
                                          rf"training\.device=cpu, or numerics\.batch_invariant=false"):
        cfg.validate()


@pytest.mark.parametrize("recipe", RECIPES)
def test_batch_invariant_on_the_cpu_and_cuda_without_it_pass(monkeypatch, recipe):
    _cuda(monkeypatch, True)
    _config(recipe, "cpu", batch_invariant=True).validate()
    _config(recipe, "cuda", batch_invariant=False).validate()
    _config(recipe, "auto", batch_invariant=False).validate()
    _cuda(monkeypatch, False)  # auto resolves to the CPU here
    _config(recipe, "auto", batch_invariant=True).validate()
