"""A tiny random transformers Kimi-K2.5 model and image+token inputs for the parity tests (a helper module)."""

from __future__ import annotations

import torch
from image_text_helpers import image_inputs as shared_image_inputs
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
PATCH, MERGE = 4, 2
PATCH_DIM = 3 * PATCH * PATCH

# DeepSeek-V3 text: 3 layers (1 dense + 2 MoE), q compression, group-limited routing, YaRN
TEXT = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=8,
            qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32.0, "beta_slow": 1.0})
# an unusual shape on purpose: 3 blocks, a 5x5 position table (resampled up and down), 2 heads of 12
VISION = dict(num_hidden_layers=3, hidden_size=24, intermediate_size=40, num_attention_heads=2, patch_size=PATCH,
              pos_emb_height=5, pos_emb_width=5, merge_kernel_size=[MERGE, MERGE])


def hf_kimi_k25(seed: int = 0, tie: bool = False) -> Kimi_K25ForConditionalGeneration:
    """A random ``Kimi_K25ForConditionalGeneration`` (eager attention, fp32, eval mode), every tensor perturbed."""
    cfg = Kimi_K25Config(text_config=dict(TEXT, tie_word_embeddings=tie), vision_config=VISION,
                         projection_hidden_size=VISION["hidden_size"], image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=tie,
                         attn_implementation="eager")
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # HF inits norms to 1 / biases to 0: perturb so a swapped one would show
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05, generator=gen)
            elif "position_embeddings" in name or "patch_embed" in name:
                p.normal_(0.0, 0.2, generator=gen)
            else:
                p.normal_(0.0, 0.2, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def image_inputs(grids: list[tuple[int, int, int]], rows: list[list[int]], seed: int = 0, length: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, pixel_values [P, 3, PATCH, PATCH], grid_thw) of this model's tokens: :func:`image_text_helpers.image_inputs`."""
    return shared_image_inputs(grids, rows, pixel_shape=(3, PATCH, PATCH), image=IMAGE, start=START, end=END, merge=MERGE,
                               seed=seed, length=length)
