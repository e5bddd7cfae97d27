"""DeepSeek-V3 family: flavors, real-shape sizes, HF config mapping, validation, slots and overrides."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.config.components import parse_override
from lockstep.config.overrides import ComponentOverride
from lockstep.models.common.mla import MLAConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.deepseek_v3 import DeepSeekV3Adapter, param_count
from lockstep.models.registry import get_model_spec, model_config, model_families, spec_for_hf_model_type

# deepseek-ai/DeepSeek-V3 config.json (architecture fields) and moonshotai/Kimi-K2-Instruct's, legacy rope keys.
DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
}
KIMI_K2_JSON = {
    **DEEPSEEK_V3_JSON, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 0,
}


def _architecture(cfg):
    """A config with the training-only knobs and names cleared, to compare architectures."""
    moe = dataclasses.replace(cfg.feed_forward, bias_update_speed=0.0, seq_aux_loss_coef=0.0)
    return dataclasses.replace(cfg, flavor="", feed_forward=moe, n_mtp=0, mtp_loss_weight=0.3)


def test_registered_for_both_hf_model_types():
    assert "deepseek_v3" in model_families()
    assert spec_for_hf_model_type("deepseek_v3").name == "deepseek_v3"
    assert spec_for_hf_model_type("kimi_k2").name == "deepseek_v3"
    assert isinstance(get_model_spec("deepseek_v3").hf_adapter, DeepSeekV3Adapter)
    assert set(get_model_spec("deepseek_v3").flavors) == {"debug", "debug_noqlora", "tiny", "671B", "kimi_k2"}


@pytest.mark.parametrize("flavor", ["debug", "debug_noqlora", "tiny"])
def test_small_flavors_train_a_step(flavor):
    cfg = model_config("deepseek_v3", flavor)
    model = build_model(cfg).train()
    assert model.num_params() == param_count(cfg)["total"]
    assert ("wq_a" in dict(model.layers["0"].attention.named_children())) == (flavor != "debug_noqlora")
    assert [cfg.is_moe_layer(i) for i in range(cfg.n_layers)] == [False] + [True] * (cfg.n_layers - 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    logits = model(tokens)
    losses, _ = model.pop_auxiliary()
    assert logits.shape == (2, 17, cfg.vocab_size) and torch.isfinite(logits).all()
    assert "mtp/loss" in losses
    (torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + sum(losses.values())).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_real_shapes_sizes():
    v3 = param_count(model_config("deepseek_v3", "671B"))
    assert round((v3["total"] - v3["mtp"]) / 1e9, 1) == 671.0  # the paper's 671B, 37B activated
    assert round(v3["active"] / 1e9, 1) == 37.6
    kimi = param_count(model_config("deepseek_v3", "kimi_k2"))
    assert round(kimi["total"] / 1e12, 3) == 1.026 and round(kimi["active"] / 1e9, 1) == 32.9
    with torch.device("meta"):
        model = model_config("deepseek_v3", "671B").build()
    assert model.num_params() == v3["total"]
    # MoE FLOPs count activated experts only: ~6 x 39B (incl. MTP and the head twice), not 6 x 683B
    assert 6 * 37e9 < model.flops_per_token(4096) < 6 * 45e9


@pytest.mark.parametrize("flavor,hf_json", [("671B", DEEPSEEK_V3_JSON), ("kimi_k2", KIMI_K2_JSON)])
def test_real_shapes_read_from_and_write_to_hf_config(flavor, hf_json):
    from transformers import DeepseekV3Config

    adapter = DeepSeekV3Adapter()
    cfg = model_config("deepseek_v3", flavor)
    from_json = adapter.config_from_hf(hf_json)
    assert _architecture(from_json) == _architecture(cfg)
    assert from_json.n_mtp == 0  # the architecture transformers runs (MTP is opt-in)
    written = adapter.config_to_hf(cfg)
    assert written["model_type"] == "deepseek_v3"  # what transformers loads natively, Kimi-K2 included
    for key, value in hf_json.items():
        if key in written and key != "model_type":
            assert written[key] == value, key
    assert written["rope_parameters"] == {"rope_type": "yarn", "rope_theta": hf_json["rope_theta"],
                                          **{k: v for k, v in hf_json["rope_scaling"].items() if k != "type"}}
    hf_cfg = DeepseekV3Config(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert hf_cfg.head_dim == 64 and hf_cfg.qk_head_dim == 192
    assert _architecture(adapter.config_from_hf(hf_cfg.to_dict())) == _architecture(cfg)


def test_mla_softmax_scale_follows_yarn_unless_set():
    cfg = model_config("deepseek_v3", "debug")  # YaRN factor 4, mscale_all_dim 1
    mscale = (0.1 * math.log(4.0) + 1.0) ** 2
    assert cfg.attention.softmax_mscale == 0.0
    assert {s.softmax_mscale for p, s in cfg.slots().items() if p.endswith(".attention")} == {mscale}
    model = build_model(cfg)
    assert model.layers["0"].attention.scale == pytest.approx(mscale / math.sqrt(16 + 8))
    assert model.rope.cos.shape[-1] == cfg.attention.qk_rope_head_dim
    fixed = cfg.replace(attention=dataclasses.replace(cfg.attention, softmax_mscale=2.0))
    assert build_model(fixed).layers["2"].attention.scale == pytest.approx(2.0 / math.sqrt(24))


def test_cli_override_keeps_mla_sizes_and_swaps_the_kernel():
    cfg = model_config("deepseek_v3", "debug")
    override = parse_override("layers.1.attention=mla,backend=reference", bases=[cfg.attention])
    assert override.config.kv_lora_rank == cfg.attention.kv_lora_rank
    model = build_model(cfg.replace(overrides=[override]))
    assert [layer.attention.backend_name for layer in model.layers.values()] == ["sdpa", "reference", "sdpa"]
    assert model.mtp["0"].block.attention.backend_name == "sdpa"  # MTP blocks have their own slots


@pytest.mark.parametrize("change,field", [
    (dict(n_kv_heads=2), "model.n_kv_heads"),
    (dict(head_dim=16), "model.head_dim"),
    (dict(first_k_dense_replace=-1), "model.first_k_dense_replace"),
    (dict(n_mtp=-1), "model.n_mtp"),
    (dict(attention=MLAConfig(qk_norm=True, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=16)), "qk_norm"),
])
def test_validation_names_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        model_config("deepseek_v3", "debug").replace(**change).validate()


def test_override_with_another_rope_width_is_refused():
    cfg = model_config("deepseek_v3", "debug")
    wide = dataclasses.replace(cfg.attention, qk_rope_head_dim=16)
    with pytest.raises(ConfigError, match="qk_rope_head_dim=16"):
        cfg.replace(overrides=[ComponentOverride(pattern="layers.2.attention", config=wide)]).validate()


def test_config_to_hf_refuses_what_hf_cannot_express():
    cfg = model_config("deepseek_v3", "debug")
    narrow = dataclasses.replace(cfg.attention, kv_lora_rank=16)
    with pytest.raises(ConfigError, match="layers.1.attention"):
        DeepSeekV3Adapter().config_to_hf(cfg.replace(overrides=[ComponentOverride(pattern="layers.1.attention",
                                                                                  config=narrow)]))
    kernel_only = parse_override("layers.*.attention=mla,backend=reference", bases=[cfg.attention])
    assert DeepSeekV3Adapter().config_to_hf(cfg.replace(overrides=[kernel_only]))["kv_lora_rank"] == 32


def test_trainer_cli_fields_reach_the_deepseek_config():
    """tyro keeps the family's config subclasses (MLA, YaRN, MoE) when parsing field flags."""
    import tyro

    from lockstep.train.config import TrainerConfig

    default = TrainerConfig(model=model_config("deepseek_v3", "tiny"))
    out = tyro.cli(TrainerConfig, default=default, args=["--model.n-mtp", "2", "--model.attention.kv-lora-rank",
                                                          "32", "--model.rope.factor", "8"])
    assert (out.model.n_mtp, out.model.attention.kv_lora_rank, out.model.rope.factor) == (2, 32, 8.0)
    assert type(out.model).__name__ == "DeepSeekV3Config" and isinstance(out.model.attention, MLAConfig)
