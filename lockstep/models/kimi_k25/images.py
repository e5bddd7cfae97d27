"""Image preprocessing for Kimi K2.5: resize, pad, normalise, patchify -- the pixels of transformers'
``Kimi_K25ImageProcessor`` (its torchvision backend, the only one transformers ships for it).

It differs from Qwen3-VL's (:mod:`lockstep.data.images`) in every step but the RGB conversion, hence its own
module:

1. ``navit_resize``: scale down only (never up) so the image holds at most ``max_patches`` patches and at
   most ``max_patches_per_side`` patches on a side (``int`` truncation of the scaled size), resize with
   torch's antialiased bicubic kernel on uint8 (what torchvision runs on CPU), then zero-pad bottom and
   right to multiples of ``patch_size * merge_size``;
2. ``(x - mean * 255) / (std * 255)`` in float32 (transformers' fused rescale + normalise);
3. patchify in raster order: ``[H/p * W/p, C * p * p]`` rows (MoonViT merges 2x2 blocks by index).

``grid_thw`` per image is ``(1, H / p, W / p)`` of the padded size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lockstep.config.base import Config, require, require_positive
from lockstep.data.images import ProcessedImages, to_rgb_array


@dataclasses.dataclass(kw_only=True)
class KimiImageProcessorConfig(Config):
    """Kimi K2.5's preprocessing settings (transformers' ``Kimi_K25ImageProcessor`` defaults)."""

    #: patch side in pixels
    patch_size: int = 14
    #: side of the square of patches merged into one decoder token
    merge_size: int = 2
    #: most patches per image after resizing
    max_patches: int = 16384
    #: most patches on one side (transformers' ``size.max_height``)
    max_patches_per_side: int = 512
    #: per-channel mean subtracted after scaling to [0, 1]
    image_mean: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.5, 0.5])
    #: per-channel std divided by
    image_std: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.5, 0.5])

    def validate(self, path: str = "images") -> None:
        for name in ("patch_size", "merge_size", "max_patches", "max_patches_per_side"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(len(self.image_mean) == 3 and len(self.image_std) == 3, f"{path}.image_mean",
                "image_mean and image_std need one value per RGB channel")
        super().validate(path)

    def preprocess(self, images: Sequence[Any]) -> ProcessedImages:
        """:func:`preprocess_images` with these settings (the processor contract of
        :mod:`lockstep.data.image_samples`, shared with Qwen3-VL's)."""
        return preprocess_images(images, self)


def navit_resize(height: int, width: int, patch: int, merge: int, max_patches: int, max_per_side: int
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)) as transformers' ``navit_resize``."""
    patches_h, patches_w = max(1.0, height // patch), max(1.0, width // patch)
    scale = min(1.0, math.sqrt(max_patches / (patches_h * patches_w)), max_per_side * patch / height,
                max_per_side * patch / width)
    new_h = min(max(1, int(height * scale)), max_per_side * patch)
    new_w = min(max(1, int(width * scale)), max_per_side * patch)
    factor = merge * patch
    return (new_h, new_w), (new_h + (factor - new_h % factor) % factor, new_w + (factor - new_w % factor) % factor)


def preprocess_image(image: Any, config: KimiImageProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (its patch rows ``[P, C*p*p]`` float32, its ``(1, grid_h, grid_w)``)."""
    pixels = torch.from_numpy(np.array(to_rgb_array(image))).permute(2, 0, 1).contiguous()[None]  # a writable copy
    p = config.patch_size
    (new_h, new_w), (pad_h, pad_w) = navit_resize(pixels.shape[2], pixels.shape[3], p, config.merge_size,
                                                  config.max_patches, config.max_patches_per_side)
    if (new_h, new_w) != tuple(pixels.shape[2:]):
        pixels = F.interpolate(pixels, size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=True)
    pixels = F.pad(pixels, (0, pad_w - new_w, 0, pad_h - new_h))  # zeros, before normalising (as transformers)
    scale = 1.0 / (1 / 255)  # transformers folds the 1/255 rescale into mean and std this way
    mean = (torch.tensor(config.image_mean) * scale).view(-1, 1, 1)
    std = (torch.tensor(config.image_std) * scale).view(-1, 1, 1)
    normalised = (pixels[0].to(torch.float32) - mean) / std
    channels, gh, gw = normalised.shape[0], pad_h // p, pad_w // p
    rows = normalised.reshape(channels, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, channels * p * p)
    return rows, (1, gh, gw)


def preprocess_images(images: Sequence[Any], config: KimiImageProcessorConfig | None = None) -> ProcessedImages:
    """Images (PIL or uint8 arrays) -> :class:`~lockstep.data.images.ProcessedImages` (rows ``[P, C*p*p]``)."""
    config = config or KimiImageProcessorConfig()
    config.validate()
    rows, grids = [], []
    for i, image in enumerate(images):
        try:
            patches, grid = preprocess_image(image, config)
        except ValueError as err:
            raise ValueError(f"images[{i}]: {err}") from None
        rows.append(patches)
        grids.append(grid)
    width = 3 * config.patch_size ** 2
    pixel_values = torch.cat(rows).numpy() if rows else np.zeros((0, width), np.float32)
    return ProcessedImages(pixel_values, np.array(grids, dtype=np.int64).reshape(-1, 3))
