"""Hugging Face ``Qwen3ForCausalLM`` checkpoints (dense Qwen3: per-head q/k RMSNorm)."""

from lockstep.models.hf.dense import DenseHFAdapter

ADAPTER = DenseHFAdapter(
    family="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    qk_norm=True,
    default_rms_norm_eps=1e-6,
    default_max_position_embeddings=32768,
    default_rope_theta=10000.0,
)
