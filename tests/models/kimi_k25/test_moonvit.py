"""MoonViT pieces and the kimi_k25 model outside the HF comparison: the bicubic position taps against
F.interpolate, the lockstep checkpoint directory round trip, batch-invariant mode with images, clear errors."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lockstep.config.base import ConfigError
from lockstep.models.common.moonvit import MoonViTConfig, bicubic_taps, merge_index
from lockstep.models.common.transformer import build_model
from lockstep.models.common.vision import patch_coordinates
from lockstep.models.registry import model_config


@pytest.mark.parametrize("side,h,w", [(5, 4, 6), (5, 8, 2), (7, 7, 7), (4, 1, 9), (64, 38, 44)])
def test_bicubic_taps_equal_f_interpolate(side, h, w):
    table = torch.randn(side, side, 6, generator=torch.Generator().manual_seed(side + h + w), dtype=torch.float64)
    grid = torch.tensor([[1, h, w]])
    index, weight = bicubic_taps(patch_coordinates(grid, 1), grid[:, 1:].repeat_interleave(h * w, 0), side)
    ours = (table.flatten(0, 1)[index] * weight[..., None].double()).sum(1)
    ref = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
    # fp64 table; source coordinates and weights in fp32 (as transformers): agreement to their rounding
    # (~1e-7 relative, times 16 taps of O(1) values and the table's slope over up to 64 cells: ~1e-5)
    assert (ours - ref[0].permute(1, 2, 0).reshape(h * w, 6)).abs().max().item() <= 5e-5


def test_merge_index_groups_2x2_blocks_in_raster_order():
    index = merge_index(torch.tensor([[1, 2, 4], [1, 2, 2]]), 2)
    assert index.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 10, 11]]


def _images(config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), config.vision.patch_dim, generator=gen)
    rows = []
    for _, h, w in grid.tolist():
        rows.append([5, config.vision_start_token_id] + [config.image_token_id] * (h * w // 4)
                    + [config.vision_end_token_id] + [7, 8])
    width = max(map(len, rows))
    tokens = torch.tensor([r + [9] * (width - len(r)) for r in rows])
    return tokens, pixels, grid


def test_lockstep_dir_round_trip(tmp_path):
    from lockstep.models.hf.io import load_lockstep_dir, save_lockstep_dir

    config = model_config("kimi_k25", "debug")
    model = build_model(config, seed=0).eval()
    save_lockstep_dir(model, tmp_path)
    again = load_lockstep_dir(tmp_path).eval()
    assert again.config == config
    tokens, pixels, grid = _images(config)
    with torch.no_grad():
        assert torch.equal(model(tokens, pixel_values=pixels, grid_thw=grid),
                           again(tokens, pixel_values=pixels, grid_thw=grid))


def test_batch_invariant_mode_with_images():
    from lockstep import numerics

    config = model_config("kimi_k25", "debug")
    model = numerics.prepare_model(build_model(config, seed=0).eval())
    tokens, pixels, grid = _images(config, seed=1)
    first = int(grid[0].prod())
    with torch.no_grad(), numerics.batch_invariant():
        batch = model(tokens, pixel_values=pixels, grid_thw=grid)
        alone = model(tokens[:1], pixel_values=pixels[:first], grid_thw=grid[:1])
    assert torch.equal(batch[:1], alone)  # a row's logits do not depend on the rest of the batch


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="model.vision.n_heads"):
        MoonViTConfig(dim=30, n_heads=4).validate("model.vision")
    config = model_config("kimi_k25", "debug")
    with pytest.raises(ConfigError, match="model.n_mtp"):
        dataclasses.replace(config, n_mtp=1).validate()
    with pytest.raises(ConfigError, match="model.image_token_id"):
        dataclasses.replace(config, image_token_id=config.vocab_size).validate()
    with pytest.raises(ValueError, match="multiples of merge_size"):
        build_model(config, seed=0).visual(torch.zeros(6, config.vision.patch_dim), torch.tensor([[1, 2, 3]]))
