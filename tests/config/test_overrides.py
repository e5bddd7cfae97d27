"""Component overrides by glob, their conflicts, and up-front validation errors."""

import dataclasses

import pytest
import torch

from lockstep.config.base import ConfigError, set_by_path
from lockstep.config.components import parse_override
from lockstep.config.overrides import ComponentOverride
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.norm import RMSNormConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config


def _with(cfg, *overrides):
    return dataclasses.replace(cfg, overrides=list(overrides))


def test_glob_override_reaches_every_matching_layer_only():
    cfg = _with(model_config("llama3", "debug"),
                ComponentOverride(pattern="layers.1.attention", config=AttentionConfig(backend="reference")))
    model = build_model(cfg)
    assert model.layers["0"].attention.backend_name == "sdpa"
    assert model.layers["1"].attention.backend_name == "reference"


def test_star_override_and_norm_override():
    cfg = _with(model_config("llama3", "debug"),
                ComponentOverride(pattern="layers.*.attention", config=AttentionConfig(backend="reference")),
                ComponentOverride(pattern="layers.0.attention_norm", config=RMSNormConfig(eps=1e-3)))
    model = build_model(cfg)
    assert {l.attention.backend_name for l in model.layers.values()} == {"reference"}
    assert model.layers["0"].attention_norm.eps == 1e-3
    assert model.layers["1"].attention_norm.eps == cfg.norm_eps
    assert model.layers["0"].ffn_norm.eps == cfg.norm_eps


def test_reference_backend_matches_sdpa_numerically():
    base = model_config("qwen3", "debug")
    ref = _with(base, ComponentOverride(pattern="layers.*.attention",
                                        config=dataclasses.replace(base.attention, backend="reference")))
    tokens = torch.randint(0, base.vocab_size, (2, 33))
    a, b = build_model(base, seed=1)(tokens), build_model(ref, seed=1)(tokens)
    # Same weights, two exact attention formulas: only fp32 rounding differs (~1e-6 relative).
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_conflicting_overrides_name_both():
    cfg = _with(model_config("llama3", "debug"),
                ComponentOverride(pattern="layers.*.attention", config=AttentionConfig(backend="reference")),
                ComponentOverride(pattern="layers.1.attention", config=AttentionConfig()))
    with pytest.raises(ConfigError, match=r"layers\.\*\.attention.*layers\.1\.attention.*layers\.1\.attention"):
        cfg.validate()


def test_override_matching_nothing_is_an_error():
    cfg = _with(model_config("llama3", "debug"),
                ComponentOverride(pattern="layers.7.attention", config=AttentionConfig()))
    with pytest.raises(ConfigError, match="matches no module"):
        cfg.validate()


def test_override_of_wrong_kind_is_an_error():
    cfg = _with(model_config("llama3", "debug"),
                ComponentOverride(pattern="layers.0.attention", config=SwiGLUConfig()))
    with pytest.raises(ConfigError, match="SwiGLUConfig"):
        cfg.validate()


def test_parse_override_keeps_model_settings_of_the_same_kind():
    base = model_config("qwen3", "debug")
    ov = parse_override("layers.*.attention=attention,backend=reference", bases=[base.attention])
    assert ov.config == AttentionConfig(backend="reference", qk_norm=True)
    with pytest.raises(ConfigError, match="unknown component kind 'nope'"):
        parse_override("layers.0.attention=nope")
    with pytest.raises(ConfigError, match="has no field 'colour'"):
        parse_override("layers.0.attention=attention,colour=red")
    with pytest.raises(ConfigError, match="expected float"):
        parse_override("norm=rmsnorm,eps=abc")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_kv_heads", 3, "model.n_kv_heads: must divide n_heads=4"),
        ("n_heads", 5, "model.n_heads: must divide dim=64"),
        ("dim", 0, "model.dim: must be > 0"),
        ("max_seq_len", -1, "model.max_seq_len: must be > 0"),
    ],
)
def test_model_validation_names_the_field(field, value, message):
    cfg = dataclasses.replace(model_config("llama3", "debug"), **{field: value})
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_attention_backend_validation_lists_choices():
    cfg = dataclasses.replace(model_config("llama3", "debug"), attention=AttentionConfig(backend="flash9"))
    with pytest.raises(ConfigError, match=r"model.attention.backend: must be one of \['batch_invariant', 'reference', 'sdpa'\]"):
        cfg.validate()


def test_set_by_path_and_unknown_field():
    cfg = model_config("llama3", "debug")
    assert set_by_path(cfg, "rope.theta", 5.0).rope.theta == 5.0
    with pytest.raises(ConfigError, match="unknown field 'rope.thetta'"):
        set_by_path(cfg, "rope.thetta", 5.0)
