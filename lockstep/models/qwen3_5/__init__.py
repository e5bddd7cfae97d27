"""Qwen3.5 family: the Qwen3-Next hybrid with split ``in_proj_qkv/z/b/a`` projections, dense (SwiGLU)
or MoE (softmax top-k + gated shared expert) flavors.

Text flavors ("<size>", "<size>-moe") are the text model (plain partial RoPE: for text the mRoPE
sections reduce to it; config and HF adapter shared with ``qwen3_next``). Image-text flavors
("<size>-vl", "<size>-moe-vl"; :mod:`.config`) add the vision tower (Qwen3-VL's, no DeepStack) and
interleaved mRoPE in the full-attention blocks; :mod:`.hf` reads and writes the full multimodal
``qwen3_5`` / ``qwen3_5_moe`` checkpoints (vision weights included).
"""

from __future__ import annotations

from lockstep.models.common.vision import VisionConfig
from lockstep.models.qwen3_5.config import QWEN35_TOKENS, Qwen3_5VLConfig, qwen3_5_vl_config, with_vision
from lockstep.models.qwen3_5.hf import ADAPTER
from lockstep.models.qwen3_next.config import Qwen3NextTransformerConfig, hybrid_config
from lockstep.models.registry import ModelSpec, register_model

_SMALL = dict(vocab_size=4096, tie_embeddings=True)
_MOE = {"debug": dict(n_experts=8, top_k=2, moe_ffn_dim=32, shared_ffn_dim=32),
        "tiny": dict(n_experts=16, top_k=4, moe_ffn_dim=128, shared_ffn_dim=128),
        "small": dict(n_experts=32, top_k=4, moe_ffn_dim=256, shared_ffn_dim=256)}
_SIZES = {"debug": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192, max_seq_len=512,
                        linear_heads=(2, 4), linear_head_dims=(16, 16)),
          "tiny": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=768, max_seq_len=1024,
                       linear_heads=(4, 8), linear_head_dims=(32, 32)),
          "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=1536, max_seq_len=2048,
                        linear_heads=(4, 8), linear_head_dims=(64, 64))}


def _q(flavor: str, **sizes) -> Qwen3NextTransformerConfig:
    return hybrid_config("qwen3_5", flavor, projection="split", **sizes)


FLAVORS = {}
for _name in ("debug", "tiny", "small"):  # dense "<size>" and MoE "<size>-moe"
    FLAVORS[_name] = (lambda n: lambda: _q(n, **_SMALL, **_SIZES[n]))(_name)
    FLAVORS[f"{_name}-moe"] = (lambda n: lambda: _q(f"{n}-moe", **_SMALL, **_SIZES[n], **_MOE[n]))(_name)
FLAVORS.update({
    # Qwen3.5-9B shapes (transformers' Qwen3_5TextConfig defaults): dense, 32 blocks (24 linear, 8 full)
    "9B": lambda: _q("9B", vocab_size=248320, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
                     ffn_dim=12288, max_seq_len=262144, linear_heads=(16, 32), linear_head_dims=(128, 128)),
    # Qwen/Qwen3.5-35B-A3B (text model): 256 experts top-8 + gated shared expert, 40 blocks (30 linear, 10 full)
    "35B-A3B": lambda: _q("35B-A3B", vocab_size=248320, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2,
                          head_dim=256, ffn_dim=512, max_seq_len=262144, linear_heads=(16, 32),
                          linear_head_dims=(128, 128), n_experts=256, top_k=8, moe_ffn_dim=512, shared_ffn_dim=512),
})

# Image-text flavors. debug: head_dim 32 so that the 8 rotated dims carry all three mRoPE axes.
_TEST_TOKENS = dict(image_token_id=4093, video_token_id=4094, vision_start_token_id=4091, vision_end_token_id=4092)
_VL = {"debug": (lambda: VisionConfig(depth=2, dim=32, ffn_dim=64, n_heads=2, patch_size=8, num_position_embeddings=64,
                                      deepstack_layers=[]), dict(head_dim=32), [2, 1, 1]),
       "tiny": (lambda: VisionConfig(depth=4, dim=128, ffn_dim=256, n_heads=4, patch_size=16,
                                     num_position_embeddings=256, deepstack_layers=[]), {}, [3, 3, 2])}


def _vl(size: str, moe: bool) -> Qwen3_5VLConfig:
    vision, text, sections = _VL[size]
    sizes = {**_SMALL, **_SIZES[size], **text, **(_MOE[size] if moe else {})}
    return qwen3_5_vl_config(f"{size}-moe-vl" if moe else f"{size}-vl", vision=vision(), mrope_section=sections,
                             tokens=_TEST_TOKENS, **sizes)


for _name in _VL:
    FLAVORS[f"{_name}-vl"] = (lambda n: lambda: _vl(n, False))(_name)
    FLAVORS[f"{_name}-moe-vl"] = (lambda n: lambda: _vl(n, True))(_name)
# the real models' tower (transformers' Qwen3_5VisionConfig defaults: 27 blocks of 1152, 2304 positions)
_REAL_VISION = dict(depth=27, dim=1152, ffn_dim=4304, n_heads=16, deepstack_layers=[])
for _name in ("9B", "35B-A3B"):
    FLAVORS[f"{_name}-vl"] = (lambda n: lambda: with_vision(
        FLAVORS[n](), flavor=f"{n}-vl", vision=VisionConfig(**_REAL_VISION), mrope_section=[11, 11, 10],
        **QWEN35_TOKENS))(_name)


SPEC = register_model(
    ModelSpec(name="qwen3_5", flavors=FLAVORS,
              hf_model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"),
              hf_adapter=ADAPTER,
              description="Qwen3.5 (Gated DeltaNet + gated attention 3:1; dense or MoE; text, or with the "
                          "vision tower and mRoPE: the -vl flavors)")
)

__all__ = ["FLAVORS", "SPEC", "Qwen3_5VLConfig"]
