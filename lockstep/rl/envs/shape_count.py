"""``shape_count``: an image question -- "How many circles are in the image?" -- over images drawn at run time.

``reset(seed)`` draws a ``image_size`` square grey canvas with 1..``max_count`` circles and up to
``distractors`` other shapes (squares, triangles), each in its own cell of a 3x3 grid (no overlaps), colours
and sizes at random: a pure function of ``seed`` (numpy's generator). The task's ``images`` hold the
picture (uint8 ``[H, W, 3]``); the rollout puts its placeholders before the question. ``step`` reads the
count from the reply -- its last number (:func:`~lockstep.rl.envs.base.extract_answer`, ``last_number``),
else its last number word ("one" .. "nine"): reward 1.0 when it equals the count. Any other reply gets
``shaping`` x the character similarity (difflib ratio) of the reply to the count's word: 0 by default
(exact answers only); a small value gives a random policy's groups reward variance (a dense signal for
smoke runs, as ``echo``'s).
"""

from __future__ import annotations

import dataclasses
import difflib
import re

import numpy as np

from lockstep.config.base import Config, require
from lockstep.data.shapes import COLOURS, shape_mask
from lockstep.rl.envs.base import StepResult, Task, extract_answer
from lockstep.rl.envs.registry import register_environment

QUESTION = "How many circles are in the image? Answer with a number."
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_WORD = re.compile(r"\b(" + "|".join(NUMBER_WORDS) + r")\b", re.IGNORECASE)
_GRID = 3  # shapes sit in distinct cells of a 3x3 grid


def draw_count_scene(seed: int, image_size: int, max_count: int, distractors: int) -> tuple[np.ndarray, int]:
    """(``[size, size, 3]`` uint8 picture, number of circles in it) of task ``seed``."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, max_count + 1))
    others = int(rng.integers(0, distractors + 1))
    cells = rng.permutation(_GRID * _GRID)[:count + others]
    image = np.full((image_size, image_size, 3), 128, dtype=np.uint8)
    cell = image_size / _GRID
    colours = list(COLOURS.values())
    for k, index in enumerate(cells):
        shape = "circle" if k < count else ("square", "triangle")[int(rng.integers(2))]
        radius = rng.uniform(0.3, 0.45) * cell
        cy = (index // _GRID + 0.5) * cell + rng.uniform(-1, 1) * (cell / 2 - radius)
        cx = (index % _GRID + 0.5) * cell + rng.uniform(-1, 1) * (cell / 2 - radius)
        image[shape_mask(shape, cy, cx, radius, image_size)] = colours[int(rng.integers(len(colours)))]
    return image, count


class ShapeCountEnv:
    name = "shape_count"

    def __init__(self, config: "ShapeCountConfig") -> None:
        self.config = config

    def reset(self, seed: int) -> Task:
        c = self.config
        image, count = draw_count_scene(seed, c.image_size, c.max_count, c.distractors)
        return Task(messages=[{"role": "user", "content": QUESTION}], answer=str(count), data={"count": count},
                    images=[image], task_id=f"shape_count#{seed}")

    def step(self, task: Task, response: str) -> StepResult:
        count, said = task.data["count"], read_count(response)
        if said == count:
            reward = 1.0
        else:
            reply = response.strip().lower()[:40]
            reward = self.config.shaping * difflib.SequenceMatcher(None, reply, NUMBER_WORDS[count]).ratio()
        return StepResult(reward=float(reward), done=True, info={"answer": said})


def read_count(text: str) -> int | None:
    """The count a reply gives: its last number, else its last number word; None when it gives neither."""
    number = extract_answer(text, "last_number")
    if number is not None:
        try:
            value = float(number.replace(",", ""))
        except ValueError:  # a fraction such as "3/4"
            return None
        return int(value) if value.is_integer() else None
    words = _WORD.findall(text)
    return NUMBER_WORDS.index(words[-1].lower()) if words else None


@register_environment("shape_count")
@dataclasses.dataclass(kw_only=True)
class ShapeCountConfig(Config):
    """Count the circles in a generated image (an image question; vision-language policies)."""

    #: side of the square picture in pixels
    image_size: int = 64
    #: most circles in a picture (at least 1)
    max_count: int = 3
    #: most other shapes (squares, triangles) beside the circles
    distractors: int = 2
    #: a wrong reply's reward is this x its character similarity to the count's word (0: exact answers only)
    shaping: float = 0.0

    def validate(self, path: str = "environment") -> None:
        require(isinstance(self.image_size, int) and self.image_size >= 16, f"{path}.image_size",
                f"must be an integer >= 16, got {self.image_size!r}")
        require(isinstance(self.max_count, int) and self.max_count >= 1, f"{path}.max_count",
                f"must be an integer >= 1, got {self.max_count!r}")
        require(isinstance(self.distractors, int) and self.distractors >= 0, f"{path}.distractors",
                f"must be an integer >= 0, got {self.distractors!r}")
        require(self.max_count + self.distractors <= _GRID * _GRID, f"{path}.max_count",
                f"max_count + distractors must be <= {_GRID * _GRID} (one grid cell each), got "
                f"{self.max_count} + {self.distractors}")
        require(0.0 <= self.shaping < 1.0, f"{path}.shaping", f"must be in [0, 1), got {self.shaping!r}")

    def build(self) -> ShapeCountEnv:
        self.validate()
        return ShapeCountEnv(self)
