"""``lockstep train --recipe debug-kimi-k25-vl``: Kimi K2.5 on the image+text rows of lockstep.data.image_mix (a shape
image + caption and a Shakespeare window in every row), its images through Kimi's own processor; the loss falls and
every MoonViT / projector tensor moves."""

from __future__ import annotations

import numpy as np

from lockstep.data.image_mix import processor_for
from lockstep.data.shapes import draw_shape
from lockstep.models.kimi_k25.images import KimiImageProcessorConfig, preprocess_images
from lockstep.recipes.vision import shakespeare_vl_model
from tests.image_text_helpers import train_vision_recipe


def test_kimi_rows_use_kimis_processor():
    """processor_for dispatches on the tower: MoonViT -> Kimi's processor with the tower's patch and merge sizes
    (raster patch rows, no temporal copies: 3 * 8 * 8 values a patch), the same pixels as calling it directly."""
    model = shakespeare_vl_model(family="kimi_k25")
    processor = processor_for(model)
    assert processor == KimiImageProcessorConfig(patch_size=8, merge_size=2)
    image = draw_shape("circle", (200, 30, 30), 64, np.random.default_rng(0))
    got, want = processor.preprocess([image]), preprocess_images([image], KimiImageProcessorConfig(patch_size=8))
    assert got.grid_thw.tolist() == [[1, 8, 8]] and got.pixel_values.shape == (64, 3 * 8 * 8)
    assert np.array_equal(got.pixel_values, want.pixel_values)


def test_debug_kimi_k25_vl_recipe_trains(tmp_path):
    cfg, batch, result, unmoved = train_vision_recipe("debug-kimi-k25-vl", tmp_path / "run")
    assert batch.grid_thw.tolist() == [[1, 8, 8]] * cfg.training.batch_size  # an image in every row
    assert ((batch.tokens == cfg.model.image_token_id).sum(dim=1) == 16).all()
    # measured 8.32 -> 7.68 in 8 steps (6.57 in a 20-step run); a step that saw no image or no gradient would
    # not move the tower
    assert result.losses[-1] < result.losses[0] - 0.4
    assert not unmoved
