"""The image+text sample format and its batches, for vision-language training and scoring.

A sample is token ids with one *marker* id wherever an image goes, plus the images in order
(:class:`ImageTextSample`). :func:`collate` preprocesses the images with the model's processor (an
:class:`ImageProcessor`: Qwen3-VL's :mod:`lockstep.data.images`, Kimi K2.5's
:mod:`lockstep.models.kimi_k25.images`), replaces each marker by ``vision_start, image_token * n, vision_end``
(``n`` = the image's merged patch count, as transformers' processors expand ``<|image_pad|>`` /
``<|media_pad|>``), right-pads the rows and builds the targets:
the next token, or ``IGNORE`` where the next token is an image placeholder or padding (image patches
are inputs, never predicted). A text-only sample is a sample without images; batches mix them freely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lockstep.data.images import ProcessedImages

#: target of positions that are not scored (cross_entropy's ignore_index)
IGNORE = -100


class ImageProcessor(Protocol):
    """A model's image preprocessing settings (``ImageProcessorConfig``, ``KimiImageProcessorConfig``)."""

    #: side of the square of patches merged into one decoder token
    merge_size: int

    def preprocess(self, images: Sequence[Any]) -> ProcessedImages:
        """Images (PIL or uint8 arrays) -> patch rows and grids, images in order."""
        ...


@dataclasses.dataclass
class ImageTextSample:
    """Token ids with ``marker`` ids where the ``images`` (PIL or uint8 arrays, in order) go."""

    tokens: list[int]
    images: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class VisionTokens:
    """The special token ids of a vision-language vocabulary (Qwen3-VL's and Kimi K2.5's config fields)."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    #: the id that marks an image's place in ``ImageTextSample.tokens``
    marker: int

    @classmethod
    def of(cls, model_config: Any, marker: int | None = None) -> "VisionTokens":
        """The ids of a vision-language model config; the marker defaults to the image token itself."""
        return cls(model_config.image_token_id, model_config.vision_start_token_id, model_config.vision_end_token_id,
                   model_config.image_token_id if marker is None else marker)


@dataclasses.dataclass
class ImageTextBatch:
    """``tokens``/``targets [B, T]``; the images of all rows, in token order: ``pixel_values [P, D]``,
    ``grid_thw [N, 3]`` (both None in a text-only batch)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor | None

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """Keyword arguments of ``Qwen3VLModel.forward`` besides the tokens."""
        return {"pixel_values": self.pixel_values, "grid_thw": self.grid_thw}

    def to(self, device: torch.device | str) -> "ImageTextBatch":
        """The batch on ``device`` (the runtime's step seam places a batch by its ``to``)."""
        move = (lambda t: None if t is None else t.to(device))
        return ImageTextBatch(move(self.tokens), move(self.targets), move(self.pixel_values), move(self.grid_thw))


def expand_markers(tokens: Sequence[int], counts: Sequence[int], ids: VisionTokens) -> list[int]:
    """``tokens`` with the i-th marker replaced by start, ``counts[i]`` image tokens, end."""
    markers = sum(1 for t in tokens if t == ids.marker)
    if markers != len(counts):
        raise ValueError(f"sample holds {markers} image marker(s) ({ids.marker}) but {len(counts)} image(s)")
    out: list[int] = []
    image = 0
    for token in tokens:
        if token != ids.marker:
            out.append(token)
            continue
        out += [ids.vision_start_token_id] + [ids.image_token_id] * counts[image] + [ids.vision_end_token_id]
        image += 1
    return out


def collate(samples: Sequence[ImageTextSample], ids: VisionTokens, processor: ImageProcessor, pad_id: int,
            seq_len: int | None = None) -> ImageTextBatch:
    """One right-padded batch, a row per sample (module docstring). ``seq_len``: the row length (default:
    the longest row); a longer row is an error naming the sample -- cutting it could split an image."""
    expanded = _expand_all(samples, ids, processor)
    rows = [row for row, _, _ in expanded]
    width = seq_len or max(len(r) for r in rows)
    too_long = [i for i, r in enumerate(rows) if len(r) > width]
    if too_long:
        raise ValueError(f"samples{too_long}: longer than seq_len={width} after expanding their images")
    return rows_batch(rows, expanded, ids, pad_id, width)


def expand_sample(sample: ImageTextSample, ids: VisionTokens, processor: ImageProcessor
              ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """``(token row with the images' placeholders, pixel_values, grid_thw)`` of one sample (images None
    without images)."""
    processed = processor.preprocess(sample.images) if sample.images else None
    counts = processed.tokens_per_image(processor.merge_size) if processed else []
    row = expand_markers(sample.tokens, counts, ids)
    if processed is None:
        return row, None, None
    return row, torch.from_numpy(processed.pixel_values), torch.from_numpy(processed.grid_thw)


def _expand_all(samples: Sequence[ImageTextSample], ids: VisionTokens, processor: ImageProcessor
                ) -> list[tuple[list[int], torch.Tensor | None, torch.Tensor | None]]:
    out = []
    for index, sample in enumerate(samples):
        try:
            out.append(expand_sample(sample, ids, processor))
        except ValueError as err:
            raise ValueError(f"samples[{index}]: {err}") from None
    return out


def rows_batch(rows: list[list[int]], expanded: list[tuple[list[int], torch.Tensor | None, torch.Tensor | None]],
           ids: VisionTokens, pad_id: int, width: int) -> ImageTextBatch:
    """Rows right-padded to ``width``, their targets, and the images of ``expanded`` (items of
    :func:`expand_sample`, in the order their images appear in the rows)."""
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        nxt = torch.tensor(row[1:], dtype=torch.long)
        targets[b, :len(row) - 1] = nxt.masked_fill(nxt == ids.image_token_id, IGNORE)
    pixels = [p for _, p, _ in expanded if p is not None]
    grids = [g for _, _, g in expanded if g is not None]
    return ImageTextBatch(tokens, targets, torch.cat(pixels) if pixels else None, torch.cat(grids) if grids else None)


def pack(samples: Sequence[ImageTextSample], ids: VisionTokens, processor: ImageProcessor, pad_id: int,
         seq_len: int) -> ImageTextBatch:
    """Whole samples, in order, packed greedily into rows of ``seq_len`` (a sample that does not fit
    starts the next row; the rest of a row is padding). Samples in one row follow each other as in
    the text :class:`~lockstep.data.loader.PackedLoader` (causal attention across them); an image is
    never split. Targets as in :func:`collate`."""
    expanded = _expand_all(samples, ids, processor)
    rows: list[list[int]] = [[]]
    for index, (row, _, _) in enumerate(expanded):
        if len(row) > seq_len:
            raise ValueError(f"samples[{index}]: {len(row)} tokens after expanding its images > seq_len={seq_len}")
        if len(rows[-1]) + len(row) > seq_len:
            rows.append([])
        rows[-1].extend(row)
    return rows_batch(rows, expanded, ids, pad_id, seq_len)


class ImageTextLoader:
    """Infinite, resumable, seeded-shuffle iterator of packed :class:`ImageTextBatch` es of
    ``batch_samples`` samples each (text-only and image+text samples mixed). Epoch ``e`` visits every
    sample once in an order that is a pure function of ``(seed, e)``; the state is ``(epoch, position)``."""

    def __init__(self, samples: Sequence[ImageTextSample], ids: VisionTokens, processor: ImageProcessor, *,
                 seq_len: int, batch_samples: int, pad_id: int = 0, seed: int = 0) -> None:
        if not samples or batch_samples <= 0 or batch_samples > len(samples):
            raise ValueError(f"batch_samples must be in [1, {len(samples)}] (the number of samples), "
                             f"got {batch_samples}")
        self.samples, self.ids, self.processor = list(samples), ids, processor
        self.seq_len, self.batch_samples, self.pad_id, self.seed = seq_len, batch_samples, pad_id, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.samples), generator=gen).tolist()

    def __iter__(self) -> "ImageTextLoader":
        return self

    def __next__(self) -> ImageTextBatch:
        if self.position + self.batch_samples > len(self.samples):  # the epoch's short tail is dropped
            self.epoch, self.position = self.epoch + 1, 0
        chosen = self._order()[self.position:self.position + self.batch_samples]
        self.position += self.batch_samples
        return pack([self.samples[i] for i in chosen], self.ids, self.processor, self.pad_id, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
