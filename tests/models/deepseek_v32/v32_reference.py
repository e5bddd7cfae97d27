"""Tiny random transformers ``DeepseekV32ForCausalLM`` references (built offline from a config).

A helper module (imported by name from the test files' directory), not a conftest."""

from __future__ import annotations

import torch

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def hf_v32(*, index_topk: int = 5, index_n_heads: int = 8, index_head_dim: int = 12, rope: dict | None = None,
           n_layers: int = 3, first_k_dense: int = 1, n_group: int = 4, topk_group: int = 2, tie: bool = False,
           attention_bias: bool = False, seed: int = 0, attn: str = "eager"):
    """A random HF DeepSeek-V3.2: 8 experts top-2 (+1 shared), 4 heads of qk 8+4 / v 8, q latent 12, an
    indexer of ``index_n_heads`` x ``index_head_dim`` keeping ``index_topk`` keys; nontrivial norms and biases.

    Many indexer heads keep exact ties of the index scores (a key whose every head's relu is 0) rare."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV32Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=8,
        q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=2, first_k_dense_replace=first_k_dense,
        max_position_embeddings=64, rope_parameters=dict(rope or YARN), tie_word_embeddings=tie,
        attention_bias=attention_bias, rms_norm_eps=1e-6, index_topk=index_topk, index_n_heads=index_n_heads,
        index_head_dim=index_head_dim, attn_implementation=attn,
    )
    model = DeepseekV32ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm.weight" in name or "layernorm" in name
                    else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model, cfg


def lockstep_from_hf(hf_model, hf_cfg):
    """The lockstep model config_from_hf + state_from_hf build from an HF model (strict load)."""
    from lockstep.models.common.transformer import build_model
    from lockstep.models.deepseek_v32 import DeepSeekV32Adapter

    adapter = DeepSeekV32Adapter()
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    model = build_model(cfg).eval()
    model.load_state_dict(adapter.state_from_hf(dict(hf_model.state_dict()), cfg), strict=True)
    return model
