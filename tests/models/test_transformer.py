"""Model shapes, meta-device init, flavors, parameter and FLOP counts."""

import dataclasses

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import get_model_spec, model_config, model_families


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_forward_shape_and_finite(family):
    cfg = model_config(family, "debug")
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_meta_build_holds_no_storage_and_init_is_seeded():
    cfg = model_config("llama3", "debug")
    with torch.device("meta"):
        meta = cfg.build()
    assert all(p.is_meta for p in meta.parameters())
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    # Rope tables are recomputed after to_empty, not left as garbage.
    assert torch.equal(a.rope.cos[0], torch.ones_like(a.rope.cos[0]))


def test_init_std_and_depth_scaling():
    cfg = dataclasses.replace(model_config("llama3", "tiny"), vocab_size=512)
    model = build_model(cfg, seed=0)
    wq = model.layers["0"].attention.wq.weight
    wo = model.layers["0"].attention.wo.weight
    assert abs(wq.std().item() - 0.02) < 0.002
    assert abs(wo.std().item() - 0.02 / (2 * cfg.n_layers) ** 0.5) < 0.001


def test_causality_future_tokens_do_not_change_past_logits():
    cfg = model_config("qwen3", "debug")
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 20))
    changed = tokens.clone()
    changed[0, 15:] = (changed[0, 15:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(tokens)[:, :15], model(changed)[:, :15], rtol=0, atol=1e-6)


def test_tied_embeddings_share_storage():
    model = build_model(model_config("qwen3", "debug"))
    assert model.output.weight is model.tok_embeddings.weight
    untied = build_model(model_config("llama3", "debug"))
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_real_shapes_parameter_counts():
    with torch.device("meta"):
        llama8b = model_config("llama3", "8B").build()
        qwen06 = model_config("qwen3", "0.6B").build()
        qwen8b = model_config("qwen3", "8B").build()
    assert llama8b.num_params() == 8_030_261_248  # Meta-Llama-3.1-8B
    assert qwen06.num_params() == 596_049_920  # Qwen3-0.6B (tied)
    assert qwen8b.num_params() == 8_190_735_360  # Qwen3-8B


def test_flops_per_token_counts_matmuls_and_attention():
    cfg = model_config("llama3", "debug")
    model = build_model(cfg)
    d, f, L, hd = cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.resolved_head_dim
    per_layer = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2 + 3 * d * f
    matmul = L * per_layer + d * cfg.vocab_size
    assert model.flops_per_token(128) == 6 * matmul + 6 * L * cfg.n_heads * hd * 128


def test_llama3_rope_scaling_changes_low_frequencies_only():
    plain = RopeConfig(theta=500000.0).inverse_frequencies(128)
    scaled = RopeConfig(theta=500000.0, scaling="llama3").inverse_frequencies(128)
    assert torch.equal(plain[:10], scaled[:10])  # high frequencies kept
    torch.testing.assert_close(scaled[-1], plain[-1] / 8.0)  # lowest divided by factor


def test_registry_lists_families_and_rejects_unknown():
    assert {"llama3", "qwen3"} <= set(model_families())
    assert {"debug", "tiny", "small"} <= set(get_model_spec("llama3").flavors)
    with pytest.raises(ConfigError, match="unknown family 'gpt9'"):
        get_model_spec("gpt9")
    with pytest.raises(ConfigError, match="no flavor 'huge'"):
        model_config("qwen3", "huge")


def test_position_beyond_rope_table_is_a_clear_error():
    cfg = dataclasses.replace(model_config("llama3", "debug"), max_seq_len=8)
    model = build_model(cfg)
    with pytest.raises(ValueError, match="beyond max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
