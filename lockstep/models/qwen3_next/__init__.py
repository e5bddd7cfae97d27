"""Qwen3-Next family: hybrid Gated DeltaNet / gated full attention (3:1), MoE with a gated shared expert.

Linear-attention blocks project with the grouped ``in_proj_qkvz`` / ``in_proj_ba`` layout; see
:mod:`lockstep.models.qwen3_next.config` (shared with ``qwen3_5``) and :mod:`.hf`.
"""

from __future__ import annotations

from lockstep.models.qwen3_next.config import Qwen3NextTransformerConfig, hybrid_config
from lockstep.models.qwen3_next.hf import HybridHFAdapter
from lockstep.models.registry import ModelSpec, register_model


def _q(flavor: str, **sizes) -> Qwen3NextTransformerConfig:
    return hybrid_config("qwen3_next", flavor, projection="grouped", **sizes)


FLAVORS = {
    # tests: 4 blocks (3 linear + 1 full), 8 experts top-2 + a shared expert
    "debug": lambda: _q("debug", vocab_size=4096, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=192, max_seq_len=512, tie_embeddings=True, linear_heads=(2, 4),
                        linear_head_dims=(16, 16), n_experts=8, top_k=2, moe_ffn_dim=32, shared_ffn_dim=32),
    # CPU-trainable
    "tiny": lambda: _q("tiny", vocab_size=4096, dim=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
                       ffn_dim=768, max_seq_len=1024, tie_embeddings=True, linear_heads=(4, 8),
                       linear_head_dims=(32, 32), n_experts=16, top_k=4, moe_ffn_dim=128, shared_ffn_dim=128),
    "small": lambda: _q("small", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
                        ffn_dim=1536, max_seq_len=2048, tie_embeddings=True, linear_heads=(4, 8),
                        linear_head_dims=(64, 64), n_experts=32, top_k=4, moe_ffn_dim=256, shared_ffn_dim=256),
    # Qwen/Qwen3-Next-80B-A3B: 512 experts top-10 + shared, 48 blocks (36 Gated DeltaNet, 12 full)
    "80B-A3B": lambda: _q("80B-A3B", vocab_size=151936, dim=2048, n_layers=48, n_heads=16, n_kv_heads=2,
                          head_dim=256, ffn_dim=5120, max_seq_len=262144, linear_heads=(16, 32),
                          linear_head_dims=(128, 128), n_experts=512, top_k=10, moe_ffn_dim=512,
                          shared_ffn_dim=512),
}

SPEC = register_model(
    ModelSpec(name="qwen3_next", flavors=FLAVORS, hf_model_types=("qwen3_next",),
              hf_adapter=HybridHFAdapter("qwen3_next"),
              description="Qwen3-Next (Gated DeltaNet + gated attention 3:1, MoE with gated shared expert)")
)

__all__ = ["FLAVORS", "SPEC", "HybridHFAdapter", "Qwen3NextTransformerConfig", "hybrid_config"]
