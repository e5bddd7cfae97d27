"""lockstep.data.images against transformers' Qwen3-VL image processor (the PIL backend, Qwen3-VL's settings):
pixel values and grid_thw bitwise equal on real photos (matplotlib's sample data) and generated images."""

import numpy as np
import pytest

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
cbook = pytest.importorskip("matplotlib.cbook")

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from lockstep.data.images import ImageProcessorConfig, preprocess_images, smart_resize  # noqa: E402

QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def reference(images, min_pixels=65536, max_pixels=16777216):
    processor = Qwen2VLImageProcessorPil(**QWEN3_VL, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    out = processor(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def check_equal(images, **pixels):
    ref_values, ref_grid = reference(images, **pixels)
    mine = preprocess_images(images, ImageProcessorConfig(**pixels))
    assert np.array_equal(mine.grid_thw, ref_grid), (mine.grid_thw.tolist(), ref_grid.tolist())
    assert mine.pixel_values.dtype == np.float32 and mine.pixel_values.shape == ref_values.shape
    # bitwise: the same PIL resize, the same float64 rescale and float32 normalisation
    assert np.array_equal(mine.pixel_values, ref_values), np.abs(mine.pixel_values - ref_values).max()
    return mine


def test_real_photos_bitwise():
    hopper = PIL.open(cbook.get_sample_data("grace_hopper.jpg"))  # 512x600 RGB photo
    logo = PIL.open(cbook.get_sample_data("logo2.png"))  # 542x130 RGBA
    mine = check_equal([hopper, logo])
    assert mine.grid_thw.tolist() == [[1, 38, 32], [1, 8, 34]]
    assert mine.tokens_per_image(2) == [304, 68]


def test_generated_images_bitwise():
    gen = np.random.default_rng(0)
    odd = gen.integers(0, 256, (37, 91, 3), dtype=np.uint8)  # upscaled to >= min_pixels
    gray = gen.integers(0, 256, (300, 200), dtype=np.uint8)  # one channel, repeated to RGB
    exact = gen.integers(0, 256, (256, 320, 3), dtype=np.uint8)  # already a multiple of 32: no resize
    check_equal([PIL.fromarray(odd), PIL.fromarray(gray), PIL.fromarray(exact)])
    # the array path (no PIL input) gives the same pixels as the PIL path
    assert np.array_equal(preprocess_images([odd]).pixel_values, preprocess_images([PIL.fromarray(odd)]).pixel_values)


def test_pixel_bounds_bitwise():
    big = PIL.fromarray(np.random.default_rng(1).integers(0, 256, (700, 500, 3), dtype=np.uint8))
    mine = check_equal([big], min_pixels=1024, max_pixels=128 * 128)
    h, w = mine.grid_thw[0, 1:] * 16
    assert h * w <= 128 * 128 and (h, w) == smart_resize(700, 500, 32, 1024, 128 * 128)


def test_bad_inputs_name_the_image():
    with pytest.raises(ValueError, match=r"images\[1\].*aspect ratio"):
        preprocess_images([np.zeros((64, 64, 3), np.uint8), np.zeros((2, 500, 3), np.uint8)])
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([np.zeros((64, 64, 3), np.float32)])
