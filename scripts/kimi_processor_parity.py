"""Kimi K2.5 image preprocessing vs transformers' Kimi_K25ImageProcessor, bitwise (pixel values and grid_thw)
on real photos (matplotlib's sample data), generated images and patch-budget limits.

transformers' Kimi processor has a torchvision backend only, and torchvision cannot live in the project's venv
(it breaks transformers' imports beside torch 2.13), so this check runs by hand with torchvision on the path
from another directory, e.g.::

    .venv/bin/pip install --no-deps --target /tmp/tv torchvision==0.28.0
    PYTHONPATH=/tmp/tv .venv/bin/python scripts/kimi_processor_parity.py

Exits non-zero on the first mismatch.
"""

import sys
from pathlib import Path

import numpy as np
import PIL.Image as PIL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models" / "kimi_k25"))
from test_kimi_k25_processor import generated, photos  # noqa: E402

from lockstep.models.kimi_k25.images import KimiImageProcessorConfig, preprocess_images  # noqa: E402,F401

def check_equal(images, **settings):
    from transformers import Kimi_K25ImageProcessor

    kwargs = {}
    if "max_patches" in settings:
        kwargs["max_patches"] = settings["max_patches"]
    if "max_patches_per_side" in settings:
        side = settings["max_patches_per_side"]
        kwargs["size"] = {"max_height": side, "max_width": side}
    ref = Kimi_K25ImageProcessor(**kwargs)(images=images, return_tensors="pt")
    mine = preprocess_images(images, KimiImageProcessorConfig(**settings))
    ref_values = ref["pixel_values"].flatten(1).numpy()
    assert np.array_equal(mine.grid_thw, ref["image_grid_thw"].numpy()), (mine.grid_thw, ref["image_grid_thw"])
    assert mine.pixel_values.dtype == np.float32 and mine.pixel_values.shape == ref_values.shape
    assert np.array_equal(mine.pixel_values, ref_values), np.abs(mine.pixel_values - ref_values).max()
    return mine


def test_real_photos_bitwise():
    check_equal(photos())


def test_generated_images_bitwise():
    check_equal(generated())


def test_patch_budget_bitwise():
    # both limits bind: the total budget (scales both sides) and the per-side cap
    big = PIL.fromarray(np.random.default_rng(1).integers(0, 256, (700, 500, 3), dtype=np.uint8))
    mine = check_equal([big], max_patches=256)
    assert int(mine.grid_thw[0, 1:].prod()) <= 256 + 2 * 2 * 16  # padding adds at most a merge row/column
    check_equal([big], max_patches_per_side=20)




def main() -> None:
    check_equal(photos())
    check_equal(generated())
    # both limits bind: the total budget (scales both sides) and the per-side cap
    big = PIL.fromarray(np.random.default_rng(1).integers(0, 256, (700, 500, 3), dtype=np.uint8))
    mine = check_equal([big], max_patches=256)
    assert int(mine.grid_thw[0, 1:].prod()) <= 256 + 2 * 2 * 16  # padding adds at most a merge row/column
    check_equal([big], max_patches_per_side=20)
    print("Kimi K2.5 preprocessing: bitwise equal to transformers' processor on every case")


if __name__ == "__main__":
    main()
