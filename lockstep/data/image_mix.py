"""Image+text training batches for ``lockstep train``: generated shape images with captions, packed with
text-only Shakespeare in every row (the ``data.images`` section, ``source = "shapes"``).

Every row of ``seq_len`` tokens holds one image+text sample -- ``<image> a red circle.<eos>``, the caption
tokenised by the run's tokenizer, the image one of :mod:`lockstep.data.shapes` -- and a text-only sample: a
window of the corpus that fills the rest of the row. Even rows put the image sample first, odd rows the
text. Every row therefore has the same number of scored tokens (``seq_len - 1`` minus the image
placeholders), so each data-parallel rank's mean loss is an equal share of the global mean: a dp layout's
loss equals one process's (tests/parallel/test_loss_parity.py).

:class:`ImageMixLoader` is the :class:`~lockstep.data.loader.PackedLoader` of these rows: infinite,
seeded shuffle per epoch (over the image samples; the text windows follow), resumable from ``(epoch,
position)``, each data-parallel rank taking its own ``batch_size`` rows of a global batch. Batches are
:class:`~lockstep.data.image_samples.ImageTextBatch` es; the LM objective passes their images to the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lockstep.config.base import Config, ConfigError, join_path, require, require_choice, require_positive
from lockstep.data.image_samples import (ImageProcessor, ImageTextBatch, ImageTextSample, VisionTokens, expand_sample,
                                         rows_batch)
from lockstep.data.images import ImageProcessorConfig
from lockstep.data.shapes import COLOURS, SHAPES, draw_shape

SOURCES = ("none", "shapes")


@dataclasses.dataclass(kw_only=True)
class ImageMixConfig(Config):
    """Image+text samples mixed into the text corpus's rows (``source = "none"``: text only)."""

    #: "none" (text only) or "shapes" (generated shape images with captions, one per row)
    source: str = "none"
    #: image+text samples of the training split (generated from ``seed``); one epoch visits each once
    train_samples: int = 256
    #: image+text samples of the validation split (generated from ``seed + 1``)
    val_samples: int = 32
    #: side of the generated square images in pixels (resized to multiples of patch * merge)
    image_size: int = 64
    #: seed of the generated images and captions
    seed: int = 0

    def validate(self, path: str = "data.images") -> None:
        super().validate(path)
        require_choice(self.source, SOURCES, join_path(path, "source"))
        for name in ("train_samples", "val_samples", "image_size"):
            require_positive(getattr(self, name), join_path(path, name))

    @property
    def enabled(self) -> bool:
        return self.source != "none"


def require_vision_tower(model_config: Any, path: str) -> None:
    """ConfigError naming ``path`` unless the model has image token ids and a vision tower whose processor is
    here (:func:`processor_for`: Qwen3-VL's ViT, Kimi K2.5's MoonViT); this module and the RL rollout use it."""
    from lockstep.models.common.moonvit import MoonViTConfig
    from lockstep.models.common.vision import VisionConfig

    family = getattr(model_config, "family", type(model_config).__name__)
    tower = getattr(model_config, "vision", None)
    if tower is None or not hasattr(model_config, "image_token_id"):
        raise ConfigError(f"{path}: image samples need a vision-language model (qwen3_vl, kimi_k25), got model "
                          f"family {family!r}")
    if not isinstance(tower, (VisionConfig, MoonViTConfig)):
        raise ConfigError(f"{path}: model family {family!r} has a {type(tower).__name__} tower, whose image "
                          f"processor is not wired in (Qwen3-VL's and Kimi K2.5's are)")


def processor_for(model_config: Any, min_pixels: int | None = None, max_pixels: int | None = None
                  ) -> ImageProcessor:
    """The image processor of a vision-language config's tower, with its patch (and temporal patch) and merge
    sizes: Qwen3-VL's (:mod:`lockstep.data.images`; pixel bounds ``min_pixels`` -- default: one merged patch,
    so small images are not scaled up -- and ``max_pixels``) or, for MoonViT, Kimi K2.5's
    (:mod:`lockstep.models.kimi_k25.images`: transformers' defaults, at most 16384 patches and 512 a side,
    never scaled up; the pixel bounds are Qwen's and do not apply)."""
    from lockstep.models.common.moonvit import MoonViTConfig
    from lockstep.models.kimi_k25.images import KimiImageProcessorConfig

    v = model_config.vision
    if isinstance(v, MoonViTConfig):
        return KimiImageProcessorConfig(patch_size=v.patch_size, merge_size=v.merge_size)
    bounds = {} if max_pixels is None else {"max_pixels": max_pixels}
    return ImageProcessorConfig(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                merge_size=v.spatial_merge_size,
                                min_pixels=min_pixels or (v.patch_size * v.spatial_merge_size) ** 2, **bounds)


def vision_tokens(model_config: Any, tokenizer_vocab: int, path: str = "data.images.source") -> VisionTokens:
    """The model's image token ids; ConfigError when the model has no vision tower or the tokenizer's ids
    reach them (a caption token would be read as an image placeholder)."""
    require_vision_tower(model_config, path)
    ids = VisionTokens.of(model_config)
    lowest = min(ids.image_token_id, ids.vision_start_token_id, ids.vision_end_token_id)
    if lowest < tokenizer_vocab:
        raise ConfigError(f"{path}: the tokenizer's ids [0, {tokenizer_vocab}) overlap the model's image token ids "
                          f"(from {lowest}); give the model a larger vocabulary with the image ids above it")
    return ids


def caption_samples(n: int, tokenizer: Any, *, marker: int, size: int, seed: int) -> list[ImageTextSample]:
    """``n`` samples ``[marker] + tokens(" a <colour> <shape>.") + [eos]`` with their shape images."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        image = draw_shape(shape, COLOURS[colour], size, rng)
        caption = tokenizer.encode(f" a {colour} {shape}.")
        samples.append(ImageTextSample([marker, *caption, tokenizer.eos_id], [image]))
    return samples


class ImageMixLoader:
    """Rows of one image+text sample + a corpus window (module docstring); yields ImageTextBatch."""

    def __init__(self, samples: list[ImageTextSample], text: torch.Tensor, ids: VisionTokens,
                 processor: ImageProcessor, *, seq_len: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, pad_id: int = 0,
                 name: str = "images") -> None:
        """``name``: the config field the samples come from (error messages start with it)."""
        self.expanded = [expand_sample(s, ids, processor) for s in samples]
        longest = max(len(row) for row, _, _ in self.expanded)
        if longest >= seq_len:
            raise ConfigError(f"training.seq_len: {seq_len} leaves no room for text beside an image sample of "
                              f"{longest} tokens ({name})")
        self.text, self.ids, self.pad_id, self.name = text, ids, pad_id, name
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        if len(samples) < self.global_batch:
            raise ConfigError(f"{name}: {len(samples)} image samples, fewer than one global batch of "
                              f"{self.global_batch} rows (batch_size x data-parallel ranks)")
        if text.numel() < seq_len:
            raise ConfigError(f"training.seq_len: {seq_len} is longer than the corpus split beside {name} "
                              f"({text.numel()} tokens)")
        self.epoch = self.position = 0

    @property
    def num_batches(self) -> int:
        """Batches per epoch (a final partial batch is dropped)."""
        return len(self.expanded) // self.global_batch

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.expanded)))
        return torch.randperm(len(self.expanded), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def _row(self, sample: int, slot: int) -> list[int]:
        """Global row ``slot`` of the stream: image sample ``sample`` and the corpus window that fills the row
        (windows taken in turn along the text split, wrapping around)."""
        image_row = self.expanded[sample][0]
        need = self.seq_len - len(image_row)
        start = (slot * self.seq_len) % max(self.text.numel() - need, 1)
        window = self.text[start:start + need].tolist()
        return image_row + window if slot % 2 == 0 else window + image_row

    def _batch(self, order: list[int], position: int, epoch: int) -> ImageTextBatch:
        first = position + self.rank * self.batch_size
        picked = order[first:first + self.batch_size]
        slots = [epoch * len(self.expanded) + first + i for i in range(len(picked))]
        rows = [self._row(s, slot) for s, slot in zip(picked, slots)]
        return rows_batch(rows, [self.expanded[s] for s in picked], self.ids, self.pad_id, self.seq_len)

    def __iter__(self) -> "ImageMixLoader":
        return self

    def __next__(self) -> ImageTextBatch:
        if self.position + self.global_batch > len(self.expanded):
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._batch(self._order(self.epoch), self.position, self.epoch)
        self.position += self.global_batch
        return batch

    def iter_epoch(self) -> Iterator[ImageTextBatch]:
        """One pass in sample order (evaluation); does not change the training state."""
        order = list(range(len(self.expanded)))
        for b in range(self.num_batches):
            yield self._batch(order, b * self.global_batch, 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "global_batch": self.global_batch, "num_samples": len(self.expanded)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in (("global_batch", self.global_batch), ("num_samples", len(self.expanded))):
            if state.get(key) != value:
                raise ValueError(f"{self.name}: loader state has {key}={state.get(key)}, this data {value}; a resumed "
                                 "run needs the same image samples and global batch")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])


def image_mix_loaders(config: ImageMixConfig, tokenizer: Any, model_config: Any, train_text: torch.Tensor,
                      val_text: torch.Tensor, *, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                      world_size: int = 1) -> tuple[ImageMixLoader, ImageMixLoader]:
    """(train, validation) loaders of ``config`` (``source = "shapes"``) for ``model_config``'s tower (its own
    processor: Qwen3-VL's or Kimi K2.5's)."""
    if model_config is None:
        raise ConfigError("data.images.source: image samples need the model config (DataConfig.build(model_config=))")
    ids = vision_tokens(model_config, tokenizer.vocab_size)
    processor = processor_for(model_config)
    common = dict(seq_len=seq_len, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
    loaders = []
    for split, n, text, offset in (("train", config.train_samples, train_text, 0),
                                   ("val", config.val_samples, val_text, 1)):
        samples = caption_samples(n, tokenizer, marker=ids.marker, size=config.image_size, seed=config.seed + offset)
        loaders.append(ImageMixLoader(samples, text, ids, processor, shuffle=split == "train",
                                      name=f"data.images.{split}_samples", **common))
    return loaders[0], loaders[1]


def check_image_training(data: Any, model: Any, parallel: Any, mode: str) -> None:
    """Refuse, before any work and naming the field, what image batches do not run with: a model without
    a vision tower, a trained tokenizer's ids reaching the image ids, cp/pp, graph mode (tp runs:
    :mod:`lockstep.parallel.visual`)."""
    images = data.images
    if not images.enabled:
        return
    # the tokenizer this config trains has data.vocab_size ids (a given tokenizer file is checked at build)
    vision_tokens(model, 0 if data.tokenizer_path else data.vocab_size)
    why = {"cp": "context parallelism shards the sequence with load-balanced chunks and shifted positions the "
                 "images' placeholders and mRoPE positions are not split by",
           "pp": "pipeline stages pass hidden states only; the tower's features and DeepStack additions are not "
                 "sent between stages"}
    for name, reason in why.items():
        require(getattr(parallel, name) == 1, f"parallel.{name}",
                f"image+text batches (data.images.source={images.source!r}) train with dp_shard, dp_replicate, ep "
                f"and tp, got {name}={getattr(parallel, name)}: {reason}")
    require(mode == "eager", "training.mode", f"image+text batches (data.images.source={images.source!r}) train in "
            f"eager mode only, got {mode!r}")
