"""Image inputs under tensor + sequence parallelism (Qwen3-VL, Qwen3.5's image-text model, Kimi K2.5).

The vision tower stays replicated: plain parameters, every tp rank encoding the same images (the tp
ranks of one data-parallel index see the same batch), or FSDP-sharded with the root unit over the
data-parallel ranks only. The decoder's residual stream is sharded on the sequence (Shard(1)), so the
:class:`~lockstep.models.common.vision.VisualInputs` the decoder takes must be this rank's part of the
sequence: the placeholder mask's columns ``[start, end)`` (torch.chunk's split, as ``Shard(1)``
splits) and the tower's rows of the placeholders inside them (the merged embeddings and every
DeepStack feature). mRoPE positions stay whole: attention runs on the gathered sequence.

Gradient: each rank's decoder gives the tower's output the gradient of its own visual positions only
(zero elsewhere); the whole-sequence gradient is their sum over tp, taken on the tower's output
(:func:`~lockstep.parallel.tp_blocks.grad_sum_region`, Megatron's ``f``) before the tower's backward.
Every rank then runs the same backward through the same tower: its parameter gradients are equal on
every rank and counted once (a plain gradient, :func:`lockstep.parallel.grad.clip_grad_norm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lockstep.models.common.vision import VisionFeatures, VisualInputs
from lockstep.models.kimi_k25.model import KimiK25Model
from lockstep.models.qwen3_vl.model import Qwen3VLModel
from lockstep.parallel.tp_blocks import grad_sum_region


def sequence_bounds(length: int, rank: int, size: int) -> tuple[int, int]:
    """Columns ``[start, end)`` of a ``length``-long sequence on rank ``rank`` of ``size`` (torch.chunk)."""
    step = -(-length // size)
    return min(rank * step, length), min((rank + 1) * step, length)


def shard_visual(visual: VisualInputs, rank: int, size: int,
                 grad_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> VisualInputs:
    """``visual`` restricted to sequence shard ``rank`` of ``size``; ``grad_sum`` (backward: the sum over
    the ranks) is applied to the tower's output before the rows are picked. A shard without placeholders
    gets empty features; its backward still joins the sum (checked by hand at tp=2)."""
    start, end = sequence_bounds(visual.mask.shape[1], rank, size)
    # features hold one row per placeholder in row-major [B, T] order: a placeholder's row is the number of
    # placeholders before it
    row = (visual.mask.flatten().cumsum(0) - 1).view_as(visual.mask)
    local = visual.mask[:, start:end]
    rows = row[:, start:end][local]
    pick = (lambda t: t[rows]) if grad_sum is None else (lambda t: grad_sum(t)[rows])
    features = visual.features
    return VisualInputs(local, VisionFeatures(pick(features.embeds), [pick(d) for d in features.deepstack]))


def apply_visual_sequence_parallel(model: nn.Module, tp_mesh) -> None:
    """Make a vision-language model's visual inputs those of its tp rank's sequence shard (module
    docstring); a model without a vision tower is left alone."""
    if not isinstance(model, (Qwen3VLModel, KimiK25Model)):  # the models with the ``shard_visual`` seam
        return
    rank, size, grad_sum = tp_mesh.get_local_rank(), tp_mesh.size(), grad_sum_region(tp_mesh)

    def shard(visual: VisualInputs) -> VisualInputs:
        return shard_visual(visual, rank, size, grad_sum)

    model.shard_visual = shard
