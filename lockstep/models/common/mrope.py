"""Interleaved multimodal RoPE (Qwen3-VL's mRoPE): one rotary table, three position axes.

Every token carries three positions -- time, height, width -- ``[3, B, T]``. Rotary frequency ``j``
(of ``head_dim / 2``) takes its angle from one axis: height for ``j % 3 == 1, j < 3 * sections[1]``,
width for ``j % 3 == 2, j < 3 * sections[2]``, time otherwise (transformers'
``Qwen3VLTextRotaryEmbedding``: "interleaved" sections). Text tokens have the same value on all three
axes, so for text-only inputs mRoPE *is* plain RoPE: ``[B, T]`` positions take the parent's table
lookup unchanged (bitwise the same tables, the same angles).

:class:`PartialMRopeConfig` is the same over the first ``rotary_dim`` dims of each head only
(Qwen3.5's gated attention: ``partial_rotary_factor`` 0.25, sections summing to ``rotary_dim / 2``);
the attention rotates those dims and passes the rest through
(:func:`lockstep.models.common.gated_attention.apply_partial_rotary`).

:func:`mrope_positions` computes the three axes for token sequences holding image placeholders
(transformers' ``get_rope_index``): text continues one step per token; an image of merged grid
``(t, h, w)`` starting at position ``s`` gets ``(s + t_i, s + h_i, s + w_i)`` and the text after it
resumes at ``s + max(h, w)``.
"""

from __future__ import annotations

import dataclasses

import torch

from lockstep.config.base import ConfigError, require
from lockstep.models.common.gated_attention import PartialRopeConfig
from lockstep.models.common.rope import RopeConfig, RotaryEmbedding


@dataclasses.dataclass(kw_only=True)
class MRopeConfig(RopeConfig):
    """Rotary embedding with interleaved time/height/width sections (Qwen3-VL)."""

    #: frequencies per axis (time, height, width); they sum to head_dim / 2
    mrope_section: list[int] = dataclasses.field(default_factory=lambda: [24, 20, 20])

    def validate(self, path: str = "") -> None:
        super().validate(path)
        require(len(self.mrope_section) == 3 and all(s >= 0 for s in self.mrope_section),
                f"{path}.mrope_section", f"must be three non-negative sizes, got {self.mrope_section}")

    def build(self, *, head_dim: int, max_seq_len: int) -> "MultimodalRotaryEmbedding":
        return MultimodalRotaryEmbedding(self, head_dim, max_seq_len)


@dataclasses.dataclass(kw_only=True)
class PartialMRopeConfig(MRopeConfig, PartialRopeConfig):
    """Interleaved mRoPE over the first ``rotary_dim(head_dim)`` dims of each head (Qwen3.5); the
    sections sum to ``rotary_dim / 2``. A :class:`PartialRopeConfig`, so text-only code paths that
    take partial RoPE take this unchanged."""

    def build(self, *, head_dim: int, max_seq_len: int) -> "MultimodalRotaryEmbedding":
        dim = self.rotary_dim(head_dim)
        require(dim >= 2 and dim % 2 == 0, "model.rope.partial_rotary_factor",
                f"rotates {dim} of head_dim={head_dim} dims; needs an even number >= 2")
        return MultimodalRotaryEmbedding(self, dim, max_seq_len)


def axis_of_frequencies(sections: list[int], n_freq: int) -> list[int]:
    """Which position axis (0 time, 1 height, 2 width) drives each of the ``n_freq`` frequencies."""
    return [j % 3 if j % 3 and j < 3 * sections[j % 3] else 0 for j in range(n_freq)]


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding that also takes ``[3, B, T]`` (time, height, width) positions."""

    def __init__(self, config: MRopeConfig, head_dim: int, max_seq_len: int) -> None:
        if sum(config.mrope_section) != head_dim // 2:
            raise ConfigError(f"model.rope.mrope_section: {config.mrope_section} must sum to head_dim/2 = "
                              f"{head_dim // 2}")
        super().__init__(config, head_dim, max_seq_len)
        axis = axis_of_frequencies(config.mrope_section, head_dim // 2)
        self.column_axis = axis + axis  # python ints: no buffer to materialise after a meta build

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, T, head_dim]``: positions ``[B, T]`` (text) or ``[3, B, T]`` (time, height, width)."""
        if positions.dim() != 3:
            return super().forward(positions)
        if positions.shape[0] != 3:
            raise ValueError(f"mRoPE positions must be [3, B, T], got {list(positions.shape)}")
        cos_axes, sin_axes = super().forward(positions)  # [3, B, T, D]: each axis's full row
        axis = torch.tensor(self.column_axis, device=positions.device)
        pick = axis.view(1, 1, 1, -1).expand(1, *cos_axes.shape[1:])
        return cos_axes.gather(0, pick)[0], sin_axes.gather(0, pick)[0]


def image_token_counts(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Placeholder tokens per image: ``t * h * w / merge_size**2`` for each row of ``grid_thw``."""
    return [int(t * h * w) // (merge_size * merge_size) for t, h, w in grid_thw.tolist()]


def mrope_positions(tokens: torch.Tensor, grid_thw: torch.Tensor, image_token_id: int, merge_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([3, B, T] positions, [B] deltas)`` for ``tokens [B, T]`` whose image placeholders
    (``image_token_id``) belong, in order over the batch, to the images of ``grid_thw [N, 3]`` (patch
    grids before merging). ``delta = max position + 1 - T``: decode step ``T + k`` is at ``T + k + delta``
    on every axis. Raises ValueError when the placeholders do not add up to the images."""
    counts = image_token_counts(grid_thw, merge_size)
    grids = grid_thw.tolist()
    out = torch.empty(3, *tokens.shape, dtype=torch.long)
    deltas = []
    image = 0
    for row, ids in enumerate(tokens.tolist()):
        pieces: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            if ids[i] != image_token_id:
                j = i
                while j < len(ids) and ids[j] != image_token_id:
                    j += 1
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos, i = pos + j - i, j
                continue
            if image >= len(grids):
                raise ValueError(f"tokens: more image placeholders than the {len(grids)} image(s) given")
            t, h, w = grids[image][0], grids[image][1] // merge_size, grids[image][2] // merge_size
            n = counts[image]
            if ids[i:i + n] != [image_token_id] * n:
                raise ValueError(f"tokens row {row}: image {image} needs {n} consecutive placeholders "
                                 f"(grid {grids[image]}, merge {merge_size})")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos, i, image = pos + max(h, w), i + n, image + 1
        row_positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
        out[:, row] = row_positions
        deltas.append(int(row_positions.max()) + 1 - len(ids) if len(ids) else 0)
    if image != len(grids):
        raise ValueError(f"tokens: placeholders for {image} image(s), but {len(grids)} image(s) given")
    return out.to(tokens.device), torch.tensor(deltas, device=tokens.device)
