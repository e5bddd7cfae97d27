"""Qwen3-MoE family: Qwen3 attention (GQA + per-head q/k RMSNorm) with a routed-expert MLP.

Every layer is MoE (softmax router, top-k, no shared experts) except those Hugging Face's
``decoder_sparse_step`` / ``mlp_only_layers`` make dense; a dense layer is a SwiGLU of ``ffn_dim``.
"""

from __future__ import annotations

from lockstep.models.qwen3_moe.config import Qwen3MoETransformerConfig, qwen3_moe_config
from lockstep.models.qwen3_moe.hf import Qwen3MoEAdapter
from lockstep.models.registry import ModelSpec, register_model

_q = qwen3_moe_config

FLAVORS = {
    # tiny model for tests: 8 experts, top-2
    "debug": lambda: _q("debug", vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=192, max_seq_len=512, tie_embeddings=True, n_experts=8, top_k=2, moe_ffn_dim=32),
    # CPU-trainable: 16 experts, top-4 of hidden 128 (active expert width 512, like a small dense MLP)
    "tiny": lambda: _q("tiny", vocab_size=4096, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32,
                       ffn_dim=768, max_seq_len=1024, tie_embeddings=True, n_experts=16, top_k=4, moe_ffn_dim=128),
    # CPU-trainable: 32 experts, top-4 of hidden 256
    "small": lambda: _q("small", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64,
                        ffn_dim=1536, max_seq_len=2048, tie_embeddings=True, n_experts=32, top_k=4,
                        moe_ffn_dim=256),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token
    "30B-A3B": lambda: _q("30B-A3B", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, ffn_dim=6144, max_seq_len=40960, n_experts=128, top_k=8,
                          moe_ffn_dim=768),
    # Qwen/Qwen3-235B-A22B: 235B parameters, 22B active per token
    "235B-A22B": lambda: _q("235B-A22B", vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                            head_dim=128, ffn_dim=12288, max_seq_len=40960, n_experts=128, top_k=8,
                            moe_ffn_dim=1536),
}

SPEC = register_model(
    ModelSpec(name="qwen3_moe", flavors=FLAVORS, hf_model_types=("qwen3_moe",), hf_adapter=Qwen3MoEAdapter(),
              description="Qwen3-MoE decoder (Qwen3 attention, softmax top-k routed SwiGLU experts)")
)

__all__ = ["FLAVORS", "SPEC", "Qwen3MoEAdapter", "Qwen3MoETransformerConfig", "qwen3_moe_config"]
