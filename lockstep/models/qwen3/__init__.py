"""Qwen3 dense family: Llama-style blocks with per-head q/k RMSNorm and explicit head_dim."""

from __future__ import annotations

from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.qwen3.hf import ADAPTER as HF_ADAPTER
from lockstep.models.registry import ModelSpec, register_model


def _qwen3(flavor: str, **sizes) -> TransformerConfig:
    return TransformerConfig(family="qwen3", flavor=flavor, norm_eps=1e-6,
                             rope=RopeConfig(theta=1000000.0),
                             attention=AttentionConfig(qk_norm=True), **sizes)


FLAVORS = {
    "debug": lambda: _qwen3("debug", vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=32, ffn_dim=192, max_seq_len=512, tie_embeddings=True),
    "tiny": lambda: _qwen3("tiny", vocab_size=4096, dim=256, n_layers=6, n_heads=8, n_kv_heads=4,
                           head_dim=32, ffn_dim=768, max_seq_len=1024, tie_embeddings=True),
    "small": lambda: _qwen3("small", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                            head_dim=64, ffn_dim=1536, max_seq_len=2048, tie_embeddings=True),
    "0.6B": lambda: _qwen3("0.6B", vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                           head_dim=128, ffn_dim=3072, max_seq_len=40960, tie_embeddings=True),
    "8B": lambda: _qwen3("8B", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                         head_dim=128, ffn_dim=12288, max_seq_len=40960),
}

SPEC = register_model(
    ModelSpec(name="qwen3", flavors=FLAVORS, hf_model_types=("qwen3",), hf_adapter=HF_ADAPTER,
              description="Qwen3 dense decoder (GQA with q/k norm, SwiGLU, RoPE theta 1e6)")
)
