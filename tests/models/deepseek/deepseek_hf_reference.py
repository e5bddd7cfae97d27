"""Tiny random transformers ``DeepseekV3ForCausalLM`` references (built offline from a config).

A helper module (imported by name from the test files' directory), not a conftest."""

from __future__ import annotations

import dataclasses

import torch

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def hf_deepseek(*, q_lora_rank: int | None = 12, rope: dict | None = None, n_layers: int = 3, first_k_dense: int = 1,
                n_group: int = 4, topk_group: int = 2, rope_interleave: bool = True, tie: bool = False,
                attention_bias: bool = False, seed: int = 0):
    """A random HF model: 8 experts top-2 (+1 shared), 4 heads of qk 8+4 / v 8, with nontrivial norms and biases.

    ``head_dim`` becomes ``qk_rope_head_dim`` inside HF's config (what its rope tables use)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=8,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=2, first_k_dense_replace=first_k_dense,
        max_position_embeddings=64, rope_parameters=dict(rope or YARN), rope_interleave=rope_interleave,
        tie_word_embeddings=tie, attention_bias=attention_bias, rms_norm_eps=1e-6,
        attn_implementation="eager",
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model, cfg


def lockstep_from_hf(hf_model, hf_cfg, **changes):
    """The lockstep model config_from_hf + state_from_hf build from an HF model (strict load)."""
    from lockstep.models.common.transformer import build_model
    from lockstep.models.deepseek_v3 import DeepSeekV3Adapter

    adapter = DeepSeekV3Adapter()
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    if changes:
        cfg = dataclasses.replace(cfg, **changes)
    model = build_model(cfg).eval()
    state = adapter.state_from_hf(dict(hf_model.state_dict()), cfg)
    if cfg.n_mtp:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith("mtp.") for k in missing)
    else:
        model.load_state_dict(state, strict=True)
    return model
