"""GPT-OSS family (openai/gpt-oss-20b, -120b): alternating sliding-window / full attention with q/k/v/o
biases and learned attention sinks, YaRN RoPE, and a mixture of experts on every layer (router with
bias, softmax over the top-k logits, clamped SwiGLU experts with biases).

HF checkpoints: model type ``gpt_oss``, unquantised (bf16/fp32) or with MXFP4 experts (dequantised on
load); see :mod:`lockstep.models.gpt_oss.hf`.
"""

from __future__ import annotations

from lockstep.models.gpt_oss.config import GptOssTransformerConfig, gpt_oss_config
from lockstep.models.gpt_oss.hf import GptOssAdapter
from lockstep.models.registry import ModelSpec, register_model

_g = gpt_oss_config

FLAVORS = {
    # tiny model for tests: 2 layers (sliding, full), window 16, 8 experts top-2
    "debug": lambda: _g("debug", vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=32, max_seq_len=512, n_experts=8, top_k=2, sliding_window=16),
    # CPU-trainable: 16 experts, top-4 of hidden 128, window 64
    "tiny": lambda: _g("tiny", vocab_size=4096, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32,
                       ffn_dim=128, max_seq_len=1024, n_experts=16, top_k=4, sliding_window=64),
    # CPU-trainable: 32 experts, top-4 of hidden 256, window 128 (the released models' window)
    "small": lambda: _g("small", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64,
                        ffn_dim=256, max_seq_len=2048, n_experts=32, top_k=4, sliding_window=128),
    # openai/gpt-oss-20b: 21B parameters, 3.6B active per token
    "20B": lambda: _g("20B", vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
                      ffn_dim=2880, max_seq_len=131072, n_experts=32, top_k=4, sliding_window=128),
    # openai/gpt-oss-120b: 117B parameters, 5.1B active per token
    "120B": lambda: _g("120B", vocab_size=201088, dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64,
                       ffn_dim=2880, max_seq_len=131072, n_experts=128, top_k=4, sliding_window=128),
}

SPEC = register_model(
    ModelSpec(name="gpt_oss", flavors=FLAVORS, hf_model_types=("gpt_oss",), hf_adapter=GptOssAdapter(),
              description="GPT-OSS decoder (sliding/full attention with sinks, top-k softmax MoE with clamped SwiGLU)")
)

__all__ = ["FLAVORS", "SPEC", "GptOssAdapter", "GptOssTransformerConfig", "gpt_oss_config"]
