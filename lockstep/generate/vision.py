"""Generation with images: what the engine does for a request's ``images`` (vision-language models).

**Request API** (:class:`lockstep.generate.Request`)::

    Request(prompt_ids=[...] or prompt="...", images=[img0, img1, ...], sampling=SamplingParams(...))

- ``images``: the request's images in prompt order; each is a PIL image, a uint8 array ``[H, W]`` /
  ``[H, W, 3]`` (preprocessed by the engine with the model's own processor,
  :func:`lockstep.data.image_mix.processor_for`: Qwen3-VL's :mod:`lockstep.data.images` with the tower's
  patch and merge sizes and ``EngineConfig.image_min_pixels`` / ``image_max_pixels``; Kimi K2.5's
  :mod:`lockstep.models.kimi_k25.images`, transformers' defaults), or a :class:`PixelImage` (already
  preprocessed: patch rows ``[t*h*w, C*tp*p*p]`` and the patch grid ``(t, h, w)``).
- The prompt holds one *run* of ``config.image_token_id`` per image, in order (each image between
  ``vision_start`` and ``vision_end``, as the chat template writes it): a run of one placeholder
  (``<|image_pad|>`` / Kimi's ``<|media_pad|>`` as a chat template renders it) is expanded to the image's
  ``t*h*w / merge**2``
  placeholders; a run that already has that length (transformers' processor output) is kept. Anything
  else is a ConfigError naming ``Request.images`` or ``Request.prompt_ids``; so are images given to a
  model without a vision tower, and placeholders in a prompt without images.
- The result's ``prompt_ids`` are the expanded prompt.

**What the engine does** (Qwen3-VL: vision tower, DeepStack, interleaved mRoPE):

1. at admission (:meth:`ImageInputs.admit`): images are preprocessed on the CPU, the prompt expanded,
   and the prompt's ``[3, n]`` mRoPE positions and its decode offset ``delta`` (transformers'
   ``rope_deltas``) computed from the grids (:func:`lockstep.models.common.mrope.mrope_positions`);
2. at prefill (:meth:`ImageInputs.prefill_batch`): the vision tower runs once per request (all its
   images in one call; each frame attends only to itself), its merged embeddings replace the placeholder
   embeddings and its DeepStack features are added at the image positions after the early blocks
   (``Transformer.trunk(visual=...)``); rotary positions are the ``[3, B, T]`` mRoPE positions (text-only
   rows: equal axes). Chunked prefill slices both per chunk (an image may straddle chunks: it was
   encoded whole). The features are dropped when the prefill ends: the KV cache holds their effect;
3. at decode (:meth:`ImageInputs.decode_positions`): the rotary position of cache position ``p`` is
   ``p + delta`` (all three axes equal, so the 2-D plain-RoPE path); the paged cache keeps ``p``.

Batches mix image and text-only requests freely. A model without ``image_positions`` (Kimi K2.5: MoonViT,
no DeepStack) keeps plain positions: the prompt's are ``0..n-1`` on all three axes and ``delta`` is 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceType
from typing import TYPE_CHECKING, Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.vision import VisionFeatures, VisualInputs

if TYPE_CHECKING:
    from lockstep.generate.config import Request
    from lockstep.generate.scheduler import Sequence


@dataclasses.dataclass
class PixelImage:
    """One image already preprocessed: ``pixel_values [t*h*w, C*tp*p*p]`` and its patch grid ``(t, h, w)``."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclasses.dataclass
class SequenceImages:
    """A sequence's images: pixels until its prefill, then only its rotary offset."""

    #: patch rows of every image, in prompt order ``[P, D]`` (None after the prefill)
    pixel_values: torch.Tensor | None
    #: patch grids ``[N, 3]``
    grid_thw: torch.Tensor
    #: the prompt's ``[3, n]`` rotary positions (None after the prefill)
    positions: torch.Tensor | None
    #: decode rotary position = cache position + delta
    delta: int
    #: prompt columns of the image placeholders, ascending
    columns: torch.Tensor


def image_pixel_bounds(model_dir: Any) -> dict[str, int]:
    """``EngineConfig`` image pixel bounds from a model directory's ``preprocessor_config.json``
    (``min_pixels`` / ``max_pixels``, or transformers 5's ``size.shortest_edge`` / ``longest_edge``);
    empty when it has none (the defaults: Qwen3-VL's)."""
    import json
    from pathlib import Path

    file = Path(model_dir) / "preprocessor_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ConfigError(f"{file}: not valid JSON ({err})") from None
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    bounds = {"image_min_pixels": config.get("min_pixels", size.get("shortest_edge")),
              "image_max_pixels": config.get("max_pixels", size.get("longest_edge"))}
    return {k: int(v) for k, v in bounds.items() if v is not None}


def has_vision(model: Any) -> bool:
    """Whether ``model`` takes images (a vision tower and ``visual_inputs``)."""
    return hasattr(model, "visual") and hasattr(model, "visual_inputs")


def refuse_images(request: "Request", model: Any) -> None:
    """ConfigError for a request with images to a model without a vision tower."""
    if request.images:
        family = getattr(getattr(model, "config", None), "family", type(model).__name__)
        raise ConfigError(f"Request.images: the model ({family}) has no vision tower; it takes text only")


def expand_placeholders(prompt: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """``prompt`` with each run of ``image_token_id`` of length 1 expanded to its image's count
    (runs already of that length kept); ConfigError when the runs do not match the images."""
    runs: list[tuple[int, int]] = []  # (start, length)
    i = 0
    while i < len(prompt):
        if prompt[i] == image_token_id:
            j = i
            while j < len(prompt) and prompt[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(counts):
        raise ConfigError(f"Request.images: {len(counts)} image(s) given, but the prompt has {len(runs)} image "
                          f"placeholder run(s) (token {image_token_id}; one per image, each image between "
                          f"vision_start and vision_end)")
    out: list[int] = []
    last = 0
    for k, ((start, length), count) in enumerate(zip(runs, counts)):
        if length not in (1, count):
            raise ConfigError(f"Request.prompt_ids: image {k} has {length} placeholder tokens; give 1 (expanded "
                              f"here) or its {count} merged patches")
        out += prompt[last:start] + [image_token_id] * count
        last = start + length
    return out + prompt[last:]


class ImageInputs:
    """The engine's image handling for one vision-language model (see the module docstring)."""

    def __init__(self, model: Any, min_pixels: int, max_pixels: int) -> None:
        from lockstep.data.image_mix import processor_for

        self.config = config = model.config
        self.image_token_id: int = config.image_token_id
        vision = config.vision
        # Qwen3-VL's VisionConfig / Kimi K2.5's MoonViTConfig (no temporal patches)
        self.merge: int = getattr(vision, "spatial_merge_size", None) or vision.merge_size
        temporal = getattr(vision, "temporal_patch_size", 1)
        self.patch_dim: int = vision.in_channels * temporal * vision.patch_size ** 2
        self.mrope = hasattr(model, "image_positions")
        #: the processor of raw images: the model's own (Qwen3-VL's with the pixel bounds, or Kimi K2.5's)
        self.processor = processor_for(config, min_pixels, max_pixels)

    @classmethod
    def for_model(cls, model: Any, min_pixels: int, max_pixels: int) -> "ImageInputs | None":
        """The image handling of ``model``, None for a text-only model."""
        return cls(model, min_pixels, max_pixels) if has_vision(model) else None

    # ------------------------------------------------------------------ admission

    def _pixels(self, images: SequenceType[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([P, D] float32 patch rows, [N, 3] grids)`` of a request's images, checked."""
        if isinstance(images, (str, bytes)) or not isinstance(images, SequenceType):
            raise ConfigError(f"Request.images: must be a list of images, got {type(images).__name__}")
        rows, grids = [], []
        for i, image in enumerate(images):
            if isinstance(image, PixelImage):
                pixels, grid = torch.as_tensor(image.pixel_values), tuple(int(g) for g in image.grid_thw)
                if len(grid) != 3 or min(grid) < 1:
                    raise ConfigError(f"Request.images[{i}].grid_thw: must be three positive sizes, got {grid}")
                if grid[1] % self.merge or grid[2] % self.merge:
                    raise ConfigError(f"Request.images[{i}].grid_thw: height and width {grid[1:]} must be "
                                      f"multiples of the merge size {self.merge}")
                if tuple(pixels.shape) != (grid[0] * grid[1] * grid[2], self.patch_dim):
                    raise ConfigError(f"Request.images[{i}].pixel_values: shape {list(pixels.shape)}, expected "
                                      f"[{grid[0] * grid[1] * grid[2]}, {self.patch_dim}] for grid {grid}")
                pixels = pixels.detach().float().cpu()
            else:
                try:
                    processed = self.processor.preprocess([image])
                except (ValueError, TypeError) as err:  # the processor names the image images[0]
                    raise ConfigError(f"Request.images[{i}]: {str(err).removeprefix('images[0]: ')}") from None
                pixels, grid = torch.from_numpy(processed.pixel_values), tuple(processed.grid_thw[0].tolist())
            rows.append(pixels)
            grids.append(grid)
        return torch.cat(rows), torch.tensor(grids, dtype=torch.long)

    def admit(self, request: "Request", prompt: list[int]) -> tuple[list[int], SequenceImages | None]:
        """(the prompt with its placeholders expanded, the sequence's image state or None)."""
        if not request.images:
            if self.image_token_id in prompt:
                raise ConfigError(f"Request.prompt_ids: the prompt holds image placeholders (token "
                                  f"{self.image_token_id}) but the request has no images")
            return prompt, None
        pixels, grid = self._pixels(request.images)
        counts = [int(t * h * w) // (self.merge * self.merge) for t, h, w in grid.tolist()]
        prompt = expand_placeholders(prompt, counts, self.image_token_id)
        tokens = torch.tensor([prompt])
        columns = (tokens[0] == self.image_token_id).nonzero().flatten()
        if self.mrope:
            from lockstep.models.common.mrope import mrope_positions

            positions, deltas = mrope_positions(tokens, grid, self.image_token_id, self.merge)
            positions, delta = positions[:, 0], int(deltas[0])
        else:
            positions, delta = torch.arange(len(prompt)).expand(3, -1), 0
        return prompt, SequenceImages(pixels, grid, positions, delta, columns)

    # ------------------------------------------------------------------ prefill

    def prefill_batch(self, runner: Any, seqs: list["Sequence"], width: int) -> "PrefillImages | None":
        """The images of a prefill batch ``[len(seqs), width]``, encoded (None: no image in the batch).
        Each sequence's pixels are released: the tower runs once per request."""
        if not any(s.visual is not None and s.visual.pixel_values is not None for s in seqs):
            return None
        weight = runner.tok_embeddings.weight
        positions = torch.zeros(3, len(seqs), width, dtype=torch.long)
        features: list[VisionFeatures | None] = []
        columns: list[torch.Tensor | None] = []
        for b, seq in enumerate(seqs):
            state = seq.visual
            if state is None:
                n = len(seq.prompt_ids)
                positions[:, b, :n] = torch.arange(n)
                features.append(None)
                columns.append(None)
                continue
            positions[:, b, : state.positions.shape[1]] = state.positions
            pixels = state.pixel_values.to(weight.device, weight.dtype)
            features.append(runner.visual(pixels, state.grid_thw.to(weight.device)))
            columns.append(state.columns)
            state.pixel_values = state.positions = None  # encoded: only the decode offset stays
        return PrefillImages(positions if self.mrope else None, features, columns, len(seqs), weight.device)

    # ------------------------------------------------------------------ decode

    @staticmethod
    def decode_positions(seqs: list["Sequence"], positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions of a decode step: ``positions [rows, T]`` (cache positions, on the device)
        plus each sequence's offset (rows past ``seqs`` are padding: unchanged)."""
        deltas = [s.visual.delta if s.visual is not None else 0 for s in seqs]
        if not any(deltas):
            return positions
        shift = torch.zeros(positions.shape[0], 1, dtype=positions.dtype)
        shift[: len(seqs), 0] = torch.tensor(deltas)
        return positions + shift.to(positions.device)


@dataclasses.dataclass
class PrefillImages:
    """A prefill batch's encoded images: ``[3, B, T]`` rotary positions (None: plain positions) and each
    row's features and placeholder columns (None for text-only rows)."""

    positions: torch.Tensor | None
    features: list[VisionFeatures | None]
    columns: list[torch.Tensor | None]
    rows: int
    device: torch.device

    def chunk(self, start: int, end: int, positions: torch.Tensor) -> tuple[torch.Tensor, VisualInputs | None]:
        """(rotary positions, visual inputs or None) of columns ``[start, end)``; ``positions``: the
        chunk's plain positions (used when the model's rotary positions are plain)."""
        rope = positions if self.positions is None else self.positions[:, :, start:end].to(self.device)
        mask = torch.zeros(self.rows, end - start, dtype=torch.bool)
        embeds, deepstack = [], []
        for b, (feats, cols) in enumerate(zip(self.features, self.columns)):
            if feats is None:
                continue
            inside = (cols >= start) & (cols < end)
            if not bool(inside.any()):
                continue
            mask[b, cols[inside] - start] = True
            pick = inside.nonzero().flatten().to(self.device)
            embeds.append(feats.embeds[pick])
            deepstack.append([d[pick] for d in feats.deepstack])
        if not embeds:
            return rope, None
        merged = VisionFeatures(torch.cat(embeds), [torch.cat(level) for level in zip(*deepstack)])
        return rope, VisualInputs(mask.to(self.device), merged)
