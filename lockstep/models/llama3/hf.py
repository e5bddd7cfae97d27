"""Hugging Face ``LlamaForCausalLM`` checkpoints (Llama 2/3/3.1/3.2, SmolLM, TinyLlama, ...)."""

from lockstep.models.hf.dense import DenseHFAdapter

ADAPTER = DenseHFAdapter(
    family="llama3",
    model_type="llama",
    architecture="LlamaForCausalLM",
    qk_norm=False,
    default_rms_norm_eps=1e-6,
    default_max_position_embeddings=2048,
    default_rope_theta=10000.0,
)
