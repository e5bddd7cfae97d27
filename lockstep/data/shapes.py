"""Generated image+caption samples: one coloured shape (circle, square, triangle) on a grey canvas.

For vision-language tests and demos without downloads. A caption is word ids from :data:`WORDS`
(``<image> a <colour> <shape> <eos>``); the colour and shape can only be read from the image, so a
model that learns to see drives its loss below the text-only optimum.
"""

from __future__ import annotations

import numpy as np

from lockstep.data.image_samples import ImageTextSample

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220)}
SHAPES = ("circle", "square", "triangle")
#: caption vocabulary: word -> id (ids start at ``first_id``)
WORDS = ("a", *COLOURS, *SHAPES, "<eos>")


def shape_mask(shape: str, cy: float, cx: float, radius: float, size: int) -> np.ndarray:
    """``[size, size]`` bool: the pixels of ``shape`` centred at ``(cy, cx)`` with ``radius``."""
    y, x = np.mgrid[0:size, 0:size] + 0.5
    if shape == "circle":
        return (y - cy) ** 2 + (x - cx) ** 2 <= radius ** 2
    if shape == "square":
        return (abs(y - cy) <= radius * 0.85) & (abs(x - cx) <= radius * 0.85)
    if shape == "triangle":
        return (y <= cy + radius * 0.8) & (abs(x - cx) <= (y - (cy - radius)) * 0.6)
    raise ValueError(f"shape {shape!r}: choose from {SHAPES}")


def draw_shape(shape: str, colour: tuple[int, int, int], size: int, rng: np.random.Generator) -> np.ndarray:
    """``[size, size, 3]`` uint8: ``shape`` in ``colour`` at a random place and scale."""
    image = np.full((size, size, 3), 128, dtype=np.uint8)
    radius = rng.uniform(0.18, 0.3) * size
    cy, cx = rng.uniform(radius, size - radius, 2)
    image[shape_mask(shape, cy, cx, radius, size)] = colour
    return image


def shape_samples(n: int, *, marker: int, first_id: int = 10, size: int = 64, seed: int = 0) -> list[ImageTextSample]:
    """``n`` samples ``[marker, a, colour, shape, <eos>]`` (word ids from ``first_id``) with their images."""
    rng = np.random.default_rng(seed)
    word = {w: first_id + i for i, w in enumerate(WORDS)}
    samples = []
    for _ in range(n):
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        image = draw_shape(shape, COLOURS[colour], size, rng)
        samples.append(ImageTextSample([marker, word["a"], word[colour], word[shape], word["<eos>"]], [image]))
    return samples
