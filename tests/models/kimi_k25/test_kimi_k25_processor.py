"""lockstep.models.kimi_k25.images: grids, padding and the processed pixels through the model.

The bitwise comparison with transformers' Kimi_K25ImageProcessor needs torchvision (its only backend),
which breaks transformers' imports inside this project's venv (shared/ECOSYSTEM.md), so it is not part of
the suite: ``scripts/kimi_processor_parity.py`` runs it by hand (docs/vision.md)."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
cbook = pytest.importorskip("matplotlib.cbook")

from lockstep.models.kimi_k25.images import KimiImageProcessorConfig, navit_resize, preprocess_images  # noqa: E402


def photos():
    hopper = PIL.open(cbook.get_sample_data("grace_hopper.jpg"))  # 512x600 RGB photo
    logo = PIL.open(cbook.get_sample_data("logo2.png"))  # 542x130 RGBA
    return [hopper, logo]


def generated():
    gen = np.random.default_rng(0)
    odd = gen.integers(0, 256, (37, 91, 3), dtype=np.uint8)  # padded up to multiples of 28, not resized
    gray = gen.integers(0, 256, (300, 200), dtype=np.uint8)  # one channel, repeated to RGB
    exact = gen.integers(0, 256, (280, 336, 3), dtype=np.uint8)  # a multiple of 28: neither resized nor padded
    return [PIL.fromarray(odd), PIL.fromarray(gray), PIL.fromarray(exact)]


def test_grids_and_padding_without_torchvision():
    mine = preprocess_images(photos())
    # 600x512 fits the budget: kept, padded to 616x532 (multiples of 28); 130x542 -> 140x560
    assert mine.grid_thw.tolist() == [[1, 44, 38], [1, 10, 40]]
    assert navit_resize(600, 512, 14, 2, 16384, 512) == ((600, 512), (616, 532))
    assert mine.tokens_per_image(2) == [44 * 38 // 4, 10 * 40 // 4]
    # padding is zero pixels, normalised: (0 - 127.5) / 127.5 = -1 in every channel
    rows = torch.from_numpy(mine.pixel_values[:44 * 38]).view(44, 38, 3, 14, 14)
    assert torch.equal(rows[-1, :, :, -1, :], torch.full((38, 3, 14), -1.0))
    assert rows[0, 0].abs().max() > 0


def test_processed_photos_run_through_the_model():
    from lockstep.models.common.transformer import build_model
    from lockstep.models.registry import model_config

    config = model_config("kimi_k25", "debug")
    vision = config.vision
    processed = preprocess_images(photos(), KimiImageProcessorConfig(patch_size=vision.patch_size, max_patches=64))
    model = build_model(config, seed=0).eval()
    tokens_per_image = processed.tokens_per_image(vision.merge_size)
    ids = [1, 2]
    for n in tokens_per_image:
        ids += [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id]
    tokens = torch.tensor([ids + [3, 4]])
    with torch.no_grad():
        logits = model(tokens, pixel_values=torch.from_numpy(processed.pixel_values),
                       grid_thw=torch.from_numpy(processed.grid_thw))
    assert logits.shape == (1, tokens.shape[1], config.vocab_size) and torch.isfinite(logits).all()
