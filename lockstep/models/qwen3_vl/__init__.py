"""Qwen3-VL family (registry name ``qwen3_vl``): vision tower + Qwen3 text decoder with interleaved mRoPE and
DeepStack, dense ("<size>") or MoE ("<size>-moe", Qwen3-VL-MoE). Reads and writes HF ``qwen3_vl`` and
``qwen3_vl_moe`` checkpoints. Only test-sized flavors are listed: real checkpoints load through
``load_hf`` (their config.json gives the shapes)."""

from __future__ import annotations

from lockstep.models.common.vision import VisionConfig
from lockstep.models.qwen3_vl.config import Qwen3VLConfig, qwen3_vl_config
from lockstep.models.qwen3_vl.hf import ADAPTER
from lockstep.models.registry import ModelSpec, register_model

# Token ids at the top of the vocabulary (as in Qwen's tokenizer, below the padded tail).
_TOKENS = dict(image_token_id=4093, video_token_id=4094, vision_start_token_id=4091, vision_end_token_id=4092)
_VISION = {
    "debug": lambda: VisionConfig(depth=2, dim=32, ffn_dim=64, n_heads=2, patch_size=8, num_position_embeddings=64,
                                  deepstack_layers=[0, 1]),
    "tiny": lambda: VisionConfig(depth=4, dim=128, ffn_dim=256, n_heads=4, patch_size=16, num_position_embeddings=256,
                                 deepstack_layers=[1, 2, 3]),
}
_SIZES = {
    "debug": dict(vocab_size=4096, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192,
                  max_seq_len=1024, tie_embeddings=True, mrope_section=[2, 3, 3]),
    "tiny": dict(vocab_size=4096, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768,
                 max_seq_len=2048, tie_embeddings=True, mrope_section=[6, 5, 5]),
}
_MOE = {"debug": dict(n_experts=8, top_k=2, moe_ffn_dim=32), "tiny": dict(n_experts=16, top_k=4, moe_ffn_dim=128)}


def _flavor(size: str, moe: bool) -> Qwen3VLConfig:
    name = f"{size}-moe" if moe else size
    return qwen3_vl_config(name, vision=_VISION[size](), **_SIZES[size], **(_MOE[size] if moe else {}), **_TOKENS)


FLAVORS = {}
for _size in _SIZES:
    FLAVORS[_size] = (lambda s: lambda: _flavor(s, False))(_size)
    FLAVORS[f"{_size}-moe"] = (lambda s: lambda: _flavor(s, True))(_size)

SPEC = register_model(
    ModelSpec(name="qwen3_vl", flavors=FLAVORS, hf_model_types=("qwen3_vl", "qwen3_vl_moe"), hf_adapter=ADAPTER,
              description="Qwen3-VL vision-language model (ViT + DeepStack + interleaved mRoPE; dense or MoE text)")
)

__all__ = ["FLAVORS", "SPEC", "Qwen3VLConfig"]
