"""Tiny random transformers Qwen3-VL models (dense and MoE) and image+token inputs for the parity tests."""

from __future__ import annotations

import torch
from image_text_helpers import image_inputs as shared_image_inputs
from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                          Qwen3VLMoeForConditionalGeneration)

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
PATCH, MERGE, TEMPORAL = 4, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
# an unusual shape on purpose: 3 blocks, DeepStack from blocks 0 and 2 into decoder blocks 0 and 1, a 5x5 position grid
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
              temporal_patch_size=TEMPORAL, out_hidden_size=64, num_position_embeddings=25,
              deepstack_visual_indexes=[0, 2])
MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)


def hf_qwen3_vl(moe: bool, seed: int = 0, tie: bool = False):
    """A random ``Qwen3VL[Moe]ForConditionalGeneration`` (eager attention, fp32, eval mode)."""
    config_cls, model_cls = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                             else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    cfg = config_cls(text_config=dict(TEXT, **(MOE if moe else {})), vision_config=VISION, image_token_id=IMAGE,
                     video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                     tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF inits norms to 1 / biases to 0: perturb so a swapped one would show
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
            elif "pos_embed" in name or "patch_embed" in name:
                p.normal_(0.0, 0.2, generator=gen)
    return model


def image_inputs(grids: list[tuple[int, int, int]], rows: list[list[int]], seed: int = 0, length: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, pixel_values [P, PATCH_DIM], grid_thw) of this model's tokens: :func:`image_text_helpers.image_inputs`."""
    return shared_image_inputs(grids, rows, pixel_shape=(PATCH_DIM,), image=IMAGE, start=START, end=END, merge=MERGE,
                               seed=seed, length=length)
