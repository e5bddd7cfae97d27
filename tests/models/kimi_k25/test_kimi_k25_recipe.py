"""``lockstep train --recipe debug-kimi-k25-vl``: Kimi K2.5 on the image+text rows of lockstep.data.image_mix (a shape
image + caption and a Shakespeare window in every row), its images through Kimi's own processor; the loss falls and
every MoonViT / projector tensor moves."""

from __future__ import annotations

import numpy as np
import torch

from lockstep.cli import resolve_config
from lockstep.data.image_mix import processor_for
from lockstep.data.shapes import draw_shape
from lockstep.models.kimi_k25.images import KimiImageProcessorConfig, preprocess_images
from lockstep.recipes.vision import shakespeare_vl_model


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
    from safetensors.torch import load_file

    from lockstep.models.common.transformer import build_model
    from lockstep.train.trainer import Trainer

    cfg, _ = resolve_config(["--recipe", "debug-kimi-k25-vl", "--steps", "8", "--run-dir", str(tmp_path / "run"),
                             "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0",
                             "--training.device", "cpu"])
    trainer = Trainer(cfg)
    batch = next(iter(trainer.data.train.iter_epoch()))
    assert batch.grid_thw.tolist() == [[1, 8, 8]] * cfg.training.batch_size  # an image in every row
    assert ((batch.tokens == cfg.model.image_token_id).sum(dim=1) == 16).all()
    result = trainer.fit()
    print(f"debug-kimi-k25-vl losses {result.losses}")
    # measured 8.32 -> 7.68 in 8 steps (6.57 in a 20-step run); a step that saw no image or no gradient would
    # not move the tower
    assert result.losses[-1] < result.losses[0] - 0.4
    trained = load_file(tmp_path / "run" / "model.safetensors")
    initial = build_model(cfg.model, seed=cfg.seed).state_dict()
    tower = [k for k in initial if k.startswith("visual.")]
    assert tower and all(not torch.equal(trained[k], initial[k]) for k in tower)
