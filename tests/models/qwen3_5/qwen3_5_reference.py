"""Tiny random transformers Qwen3.5 image-text models (dense and MoE) and image+token inputs for the
parity tests (a helper module)."""

from __future__ import annotations

import torch
from image_text_helpers import image_inputs as shared_image_inputs
from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration)

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
PATCH, MERGE, TEMPORAL = 4, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH

# unusual on purpose: full attention first and last around one Gated DeltaNet block, half of each
# 16-wide head rotated (8 dims: 4 frequencies, mRoPE sections 2 time / 1 height / 1 width)
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            initializer_range=0.1, layer_types=["full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
# 2 blocks, a 5x5 learned position grid (resampled to every image's grid)
VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
              temporal_patch_size=TEMPORAL, out_hidden_size=48, num_position_embeddings=25)
MOE = dict(moe_intermediate_size=20, shared_expert_intermediate_size=28, num_experts=4, num_experts_per_tok=2)


def hf_qwen3_5(moe: bool, seed: int = 0, tie: bool = False):
    """A random ``Qwen3_5[Moe]ForConditionalGeneration`` (eager attention, fp32, eval mode), every tensor
    perturbed (HF zeroes the zero-centred norms, LayerNorm biases, ...)."""
    config_cls, model_cls = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                             else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    cfg = config_cls(text_config=dict(TEXT, **(MOE if moe else {})), vision_config=VISION, image_token_id=IMAGE,
                     video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                     tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual.") and name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))  # LayerNorm scales
            elif name.endswith("bias") or p.ndim == 1:  # zero-centred norms, dt_bias, A_log, biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    if tie:
        model.tie_weights()
    return model


def image_inputs(grids: list[tuple[int, int, int]], rows: list[list[int]], seed: int = 0, length: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, pixel_values [P, PATCH_DIM], grid_thw) of these tokens: :func:`image_text_helpers.image_inputs`."""
    return shared_image_inputs(grids, rows, pixel_shape=(PATCH_DIM,), image=IMAGE, start=START, end=END, merge=MERGE,
                               seed=seed, length=length)
