"""Llama 3 family: GQA + SwiGLU + RMSNorm with Llama-3 RoPE frequency scaling."""

from __future__ import annotations

from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.llama3.hf import ADAPTER as HF_ADAPTER
from lockstep.models.registry import ModelSpec, register_model


def _llama3(flavor: str, **sizes) -> TransformerConfig:
    rope = sizes.pop("rope", None) or RopeConfig(theta=500000.0)
    return TransformerConfig(family="llama3", flavor=flavor, rope=rope, **sizes)


def _llama31_rope() -> RopeConfig:
    return RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)


FLAVORS = {
    # tiny model for tests: seconds per run
    "debug": lambda: _llama3("debug", vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=192, max_seq_len=512),
    # CPU-trainable (~7M params with a 4k vocab): the default `make run` model
    "tiny": lambda: _llama3("tiny", vocab_size=4096, dim=256, n_layers=6, n_heads=8, n_kv_heads=4,
                            ffn_dim=768, max_seq_len=1024),
    # CPU-trainable (~30M params with a 4k vocab)
    "small": lambda: _llama3("small", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                             ffn_dim=1536, max_seq_len=2048),
    "1B": lambda: _llama3("1B", vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                          head_dim=64, ffn_dim=8192, max_seq_len=131072, tie_embeddings=True,
                          rope=RopeConfig(theta=500000.0, scaling="llama3", factor=32.0,
                                          original_max_position_embeddings=8192)),
    "8B": lambda: _llama3("8B", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          ffn_dim=14336, max_seq_len=131072, rope=_llama31_rope()),
    "70B": lambda: _llama3("70B", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                           ffn_dim=28672, max_seq_len=131072, rope=_llama31_rope()),
}

SPEC = register_model(
    ModelSpec(name="llama3", flavors=FLAVORS, hf_model_types=("llama",), hf_adapter=HF_ADAPTER,
              description="Llama 3 / 3.1 dense decoder (GQA, SwiGLU, RoPE with llama3 scaling)")
)
