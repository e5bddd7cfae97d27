"""Image preprocessing for Qwen3-VL: resize, patchify, normalise -- the same pixels as transformers' processor.

Matches ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` gives ``qwen3_vl`` with the PIL backend)
configured as Qwen3-VL's ``preprocessor_config.json`` (patch 16, merge 2, temporal patch 2, mean = std =
0.5, 65536..16777216 pixels):

1. RGB; ``smart_resize``: height and width rounded to multiples of ``patch_size * merge_size`` with the
   pixel count brought into ``[min_pixels, max_pixels]`` keeping the aspect ratio; bicubic (PIL);
2. ``x / 255`` (in float64, then float32), then ``(x - mean) / std``;
3. patchify: ``[C, H, W]`` -> ``[grid_h * grid_w, C * temporal * p * p]`` rows, patches in merge-block
   order (each ``merge x merge`` block's patches adjacent; the vision tower merges by reshaping) and
   the single frame repeated ``temporal_patch_size`` times.

``grid_thw`` per image is ``(1, H / p, W / p)``. transformers' torchvision backend resizes with
torchvision's bicubic kernel instead of PIL's, which moves some pixels by a grey level or two
(tests/models/qwen3_vl/test_qwen3_vl_processor.py measures both).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lockstep.config.base import Config, ConfigError, require, require_positive


@dataclasses.dataclass(kw_only=True)
class ImageProcessorConfig(Config):
    """Qwen3-VL's preprocessing settings (its preprocessor_config.json)."""

    #: patch side in pixels
    patch_size: int = 16
    #: frames per patch (an image is repeated to fill them)
    temporal_patch_size: int = 2
    #: side of the square of patches merged into one decoder token
    merge_size: int = 2
    #: fewest pixels after resizing
    min_pixels: int = 65536
    #: most pixels after resizing
    max_pixels: int = 16777216
    #: per-channel mean subtracted after scaling to [0, 1]
    image_mean: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.5, 0.5])
    #: per-channel std divided by
    image_std: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.5, 0.5])

    def validate(self, path: str = "images") -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(self.min_pixels <= self.max_pixels, f"{path}.min_pixels", "must not exceed max_pixels")
        require(len(self.image_mean) == 3 and len(self.image_std) == 3, f"{path}.image_mean",
                "image_mean and image_std need one value per RGB channel")
        super().validate(path)

    def preprocess(self, images: Sequence[Any]) -> "ProcessedImages":
        """:func:`preprocess_images` with these settings (the processor contract Kimi K2.5's shares)."""
        return preprocess_images(images, self)


@dataclasses.dataclass
class ProcessedImages:
    """``pixel_values [patches, C * temporal * p * p]`` float32 and ``grid_thw [images, 3]`` int64."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """Placeholder tokens each image takes in the text (``t * h * w / merge**2``)."""
        return [int(np.prod(g)) // (merge_size * merge_size) for g in self.grid_thw]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of ``factor``, pixel count within bounds, aspect ratio kept (transformers')."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {height}x{width}: aspect ratio above 200 is not supported")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency of the vision path
        raise ConfigError("image preprocessing needs Pillow (pip install -c constraints.txt pillow)") from None
    return Image


def to_rgb_array(image: Any) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB of a PIL image (converted to RGB) or a uint8 array ``[H, W]`` / ``[H, W, 3]``."""
    if hasattr(image, "convert"):
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.dtype != np.uint8:
        raise ValueError(f"image arrays must be uint8 [H, W] or [H, W, 3], got {array.dtype} {array.shape}")
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"image arrays must be [H, W] or [H, W, 3], got shape {array.shape}")
    return array


def patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """``[C, H, W]`` float32 -> ``[H/p * W/p, C * temporal * p * p]`` in merge-block order."""
    channels, height, width = image.shape
    gh, gw = height // patch, width // patch
    blocks = image.reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, patch, patch))
    return frames.reshape(gh * gw, channels * temporal * patch * patch)


def preprocess_image(image: Any, config: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (its patch rows, its ``(1, grid_h, grid_w)``)."""
    rgb = to_rgb_array(image)
    factor = config.patch_size * config.merge_size
    height, width = smart_resize(rgb.shape[0], rgb.shape[1], factor, config.min_pixels, config.max_pixels)
    if (height, width) != rgb.shape[:2]:
        pil = _pil()
        rgb = np.asarray(pil.fromarray(rgb).resize((width, height), resample=pil.Resampling.BICUBIC))
    scaled = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    mean = np.array(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.array(config.image_std, dtype=np.float32)[:, None, None]
    normalised = (scaled - mean) / std
    rows = patchify(normalised, config.patch_size, config.merge_size, config.temporal_patch_size)
    return rows, (1, height // config.patch_size, width // config.patch_size)


def preprocess_images(images: Sequence[Any], config: ImageProcessorConfig | None = None) -> ProcessedImages:
    """Images (PIL or uint8 arrays) -> :class:`ProcessedImages`, images in order."""
    config = config or ImageProcessorConfig()
    config.validate()
    rows, grids = [], []
    for i, image in enumerate(images):
        try:
            patches, grid = preprocess_image(image, config)
        except ValueError as err:
            raise ValueError(f"images[{i}]: {err}") from None
        rows.append(patches)
        grids.append(grid)
    width = 3 * config.temporal_patch_size * config.patch_size ** 2
    pixel_values = np.concatenate(rows) if rows else np.zeros((0, width), np.float32)
    return ProcessedImages(pixel_values.astype(np.float32, copy=False), np.array(grids, dtype=np.int64).reshape(-1, 3))
