"""Qwen3.5 family (text model): the Qwen3-Next hybrid with split ``in_proj_qkv/z/b/a`` projections,
dense (SwiGLU) or MoE (softmax top-k + gated shared expert) flavors. Text positions only: the mRoPE
sections of the multimodal model reduce to plain partial RoPE for text (see
:mod:`lockstep.models.common.gated_attention`). Config and HF adapter are shared with ``qwen3_next``.
"""

from __future__ import annotations

from lockstep.models.qwen3_next.config import Qwen3NextTransformerConfig, hybrid_config
from lockstep.models.qwen3_next.hf import HybridHFAdapter
from lockstep.models.registry import ModelSpec, register_model

_SMALL = dict(vocab_size=4096, tie_embeddings=True)
_MOE = {"debug": dict(n_experts=8, top_k=2, moe_ffn_dim=32, shared_ffn_dim=32),
        "tiny": dict(n_experts=16, top_k=4, moe_ffn_dim=128, shared_ffn_dim=128),
        "small": dict(n_experts=32, top_k=4, moe_ffn_dim=256, shared_ffn_dim=256)}
_SIZES = {"debug": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192, max_seq_len=512,
                        linear_heads=(2, 4), linear_head_dims=(16, 16)),
          "tiny": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=768, max_seq_len=1024,
                       linear_heads=(4, 8), linear_head_dims=(32, 32)),
          "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=1536, max_seq_len=2048,
                        linear_heads=(4, 8), linear_head_dims=(64, 64))}


def _q(flavor: str, **sizes) -> Qwen3NextTransformerConfig:
    return hybrid_config("qwen3_5", flavor, projection="split", **sizes)


FLAVORS = {}
for _name in ("debug", "tiny", "small"):  # dense "<size>" and MoE "<size>-moe"
    FLAVORS[_name] = (lambda n: lambda: _q(n, **_SMALL, **_SIZES[n]))(_name)
    FLAVORS[f"{_name}-moe"] = (lambda n: lambda: _q(f"{n}-moe", **_SMALL, **_SIZES[n], **_MOE[n]))(_name)
FLAVORS.update({
    # Qwen3.5-9B shapes (transformers' Qwen3_5TextConfig defaults): dense, 32 blocks (24 linear, 8 full)
    "9B": lambda: _q("9B", vocab_size=248320, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
                     ffn_dim=12288, max_seq_len=262144, linear_heads=(16, 32), linear_head_dims=(128, 128)),
    # Qwen/Qwen3.5-35B-A3B (text model): 256 experts top-8 + gated shared expert, 40 blocks (30 linear, 10 full)
    "35B-A3B": lambda: _q("35B-A3B", vocab_size=248320, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2,
                          head_dim=256, ffn_dim=512, max_seq_len=262144, linear_heads=(16, 32),
                          linear_head_dims=(128, 128), n_experts=256, top_k=8, moe_ffn_dim=512, shared_ffn_dim=512),
})

SPEC = register_model(
    ModelSpec(name="qwen3_5", flavors=FLAVORS,
              hf_model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"),
              hf_adapter=HybridHFAdapter("qwen3_5"),
              description="Qwen3.5 text model (Gated DeltaNet + gated attention 3:1; dense or MoE)")
)

__all__ = ["FLAVORS", "SPEC"]
