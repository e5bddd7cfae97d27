"""The start-up parity check the trainer records: every family against transformers."""

import pytest

from lockstep.models.hf.parity import TOLERANCE, family_parity


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_family_parity_passes_and_reports(family):
    result = family_parity(family)
    assert result["ran"] is True and result["family"] == family
    assert result["max_abs_diff"] <= TOLERANCE and result["passed"] is True


def test_parity_detects_a_different_model(monkeypatch):
    # If lockstep computed another function (here: RoPE off by a factor in theta), the check fails.
    import lockstep.models.hf.parity as parity
    from lockstep.models import registry

    original = registry.model_config

    def skewed(family, flavor):
        cfg = original(family, flavor)
        cfg.rope.theta *= 3
        return cfg

    monkeypatch.setattr(registry, "model_config", skewed)
    import lockstep.models.hf.io as io

    real_save = io.save_hf

    def save_with_original_theta(model, path, *a, **k):
        model.config.rope.theta /= 3  # transformers gets the original theta
        try:
            return real_save(model, path, *a, **k)
        finally:
            model.config.rope.theta *= 3

    monkeypatch.setattr(io, "save_hf", save_with_original_theta)
    result = parity.family_parity("llama3")
    assert result["passed"] is False and result["max_abs_diff"] > TOLERANCE
