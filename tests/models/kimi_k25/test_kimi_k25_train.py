"""A tiny Kimi K2.5 (debug flavor) trained on generated shape images + captions (lockstep.data.shapes), preprocessed
by the Kimi processor: the caption loss falls and MoonViT, its projector and the decoder all get gradients."""

import torch
import torch.nn.functional as F

from lockstep.data.image_samples import IGNORE, VisionTokens, expand_markers
from lockstep.data.shapes import shape_samples
from lockstep.models.common.transformer import build_model
from lockstep.models.kimi_k25.images import KimiImageProcessorConfig, preprocess_images
from lockstep.models.registry import model_config

# 64x64 images, 8-pixel patches: an 8x8 patch grid (the debug tower's 8x8 position table), 16 image tokens
PROCESSOR = KimiImageProcessorConfig(patch_size=8, max_patches=64)


def batch(samples, ids):
    """(tokens, targets, pixel_values, grid_thw): one row per sample (all the same length here)."""
    processed = preprocess_images([s.images[0] for s in samples], PROCESSOR)
    counts = processed.tokens_per_image(PROCESSOR.merge_size)
    tokens = torch.tensor([expand_markers(s.tokens, [n], ids) for s, n in zip(samples, counts)])
    targets = tokens[:, 1:].masked_fill(tokens[:, 1:] == ids.image_token_id, IGNORE)
    targets = F.pad(targets, (0, 1), value=IGNORE)
    return tokens, targets, torch.from_numpy(processed.pixel_values), torch.from_numpy(processed.grid_thw)


def test_tiny_kimi_k25_learns_shape_captions():
    torch.manual_seed(0)
    config = model_config("kimi_k25", "debug")
    model = build_model(config, seed=0).train()
    ids = VisionTokens.of(config)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.0)
    samples = shape_samples(60, marker=ids.image_token_id, seed=1)
    losses = []
    for step in range(15):
        tokens, targets, pixels, grid = batch(samples[(step * 6) % 60:(step * 6) % 60 + 6], ids)
        assert grid.tolist() == [[1, 8, 8]] * 6
        logits = model(tokens, pixel_values=pixels, grid_thw=grid)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        aux, _ = model.pop_auxiliary()
        opt.zero_grad()
        (loss + sum(aux.values())).backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"shape captions: loss {first:.3f} -> {last:.3f} in {len(losses)} steps")
    assert last < 0.5 * first
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.visual.parameters())
