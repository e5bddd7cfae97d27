"""Kimi K2.5 family (registry name ``kimi_k25``): MoonViT vision tower + projector and the DeepSeek-V3 text
decoder. Reads and writes HF ``kimi_k25`` checkpoints (transformers' ``Kimi_K25ForConditionalGeneration``).
A test-sized flavor, and the release shape (``K2.5``: Kimi-K2's decoder, MoonViT-400M) for parameter counting.
"""

from __future__ import annotations

import dataclasses

from lockstep.models.common.moonvit import MoonViTConfig
from lockstep.models.deepseek_v3 import FLAVORS as _DEEPSEEK_V3
from lockstep.models.kimi_k25.config import KimiK25Config, kimi_k25_config
from lockstep.models.kimi_k25.hf import ADAPTER
from lockstep.models.registry import ModelSpec, register_model


def _debug() -> KimiK25Config:
    # the deepseek_v3 debug decoder (4k vocab, 3 layers: 1 dense + 2 MoE), a 2-block MoonViT on 8-pixel patches;
    # special tokens at the top of the vocabulary
    text = dataclasses.replace(_DEEPSEEK_V3["debug"](), n_mtp=0, tie_embeddings=True)
    vision = MoonViTConfig(depth=2, dim=32, ffn_dim=64, n_heads=2, patch_size=8, pos_emb_side=8)
    return kimi_k25_config(text, vision, flavor="debug", image_token_id=4093, video_token_id=4094,
                           vision_start_token_id=4091, vision_end_token_id=4092)


def _release() -> KimiK25Config:
    # moonshotai/Kimi-K2.5: the Kimi-K2 decoder (1.03T parameters, 384 experts) and MoonViT (27 blocks of 1152,
    # 14-pixel patches, a 64x64 position table, 2x2 merge); head not tied
    return kimi_k25_config(_DEEPSEEK_V3["kimi_k2"](), MoonViTConfig(), flavor="K2.5")


FLAVORS = {"debug": _debug, "K2.5": _release}

SPEC = register_model(
    ModelSpec(name="kimi_k25", flavors=FLAVORS, hf_model_types=("kimi_k25",), hf_adapter=ADAPTER,
              description="Kimi K2.5 vision-language model (MoonViT + projector; DeepSeek-V3 / Kimi-K2 text)")
)

__all__ = ["FLAVORS", "SPEC", "KimiK25Config"]
