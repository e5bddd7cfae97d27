"""Qwen3-VL family (registry name ``qwen3_vl``): vision tower + Qwen3 text decoder with interleaved mRoPE and
DeepStack, dense ("<size>") or MoE ("<size>-moe", Qwen3-VL-MoE). Reads and writes HF ``qwen3_vl`` and
``qwen3_vl_moe`` checkpoints. Test-sized flavors, plus the shapes of Qwen/Qwen3-VL-2B, -8B and -30B-A3B
(parameter counts checked against transformers built from the same config)."""

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

_QWEN_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653)
_VIT_SMALL = dict(depth=24, dim=1024, ffn_dim=4096, n_heads=16, deepstack_layers=[5, 11, 17])
_VIT_LARGE = dict(depth=27, dim=1152, ffn_dim=4304, n_heads=16, deepstack_layers=[8, 16, 24])
_REAL = dict(vocab_size=151936, head_dim=128, max_seq_len=262144, mrope_section=[24, 20, 20], **_QWEN_TOKENS)
FLAVORS.update({
    "2B": lambda: qwen3_vl_config("2B", vision=VisionConfig(**_VIT_SMALL), dim=2048, n_layers=28, n_heads=16,
                                  n_kv_heads=8, ffn_dim=6144, tie_embeddings=True, **_REAL),
    "8B": lambda: qwen3_vl_config("8B", vision=VisionConfig(**_VIT_LARGE), dim=4096, n_layers=36, n_heads=32,
                                  n_kv_heads=8, ffn_dim=12288, **_REAL),
    "30B-A3B": lambda: qwen3_vl_config("30B-A3B", vision=VisionConfig(**_VIT_LARGE), dim=2048, n_layers=48, n_heads=32,
                                       n_kv_heads=4, ffn_dim=6144, n_experts=128, top_k=8, moe_ffn_dim=768, **_REAL),
})

SPEC = register_model(
    ModelSpec(name="qwen3_vl", flavors=FLAVORS, hf_model_types=("qwen3_vl", "qwen3_vl_moe"), hf_adapter=ADAPTER,
              description="Qwen3-VL vision-language model (ViT + DeepStack + interleaved mRoPE; dense or MoE text)")
)

__all__ = ["FLAVORS", "SPEC", "Qwen3VLConfig"]
