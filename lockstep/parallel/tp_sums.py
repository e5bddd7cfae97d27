"""Batch-invariant log-probabilities across tensor-parallel degrees: give one layout another's row sums.

In batch-invariant mode (docs/numerics.md) a TP-n layout (:func:`lockstep.parallel.parallelize.apply_dense_tp`,
with or without sequence parallelism) computes what one process computes everywhere but in its
row-parallel layers: every column-parallel output is its own dot product over all of K, each
attention head is computed whole on one rank, norms are per row, and the vocabulary-parallel
embedding and head gather exact values. A row-parallel layer (GQA's ``wo``, SwiGLU's ``w2``) sums
K as n rank partials added by :func:`lockstep.ops.tp_invariant.tree_sum`
(:class:`~lockstep.ops.tp_invariant.OrderedSum`).

``split_row_parallel_sums(model, n)`` makes those layers of a model sum K in n slices the same way
(:class:`lockstep.numerics.SwitchableLinear`'s ``k_split``): a one-process model (or FSDP: its
forward sees whole weights) split ``n`` ways computes TP-n's bits, and a TP-a model split ``b / a``
ways computes TP-b's (``tree_sum`` over ranks of ``tree_sum`` within a rank is the tree over all
slices when ``b / a`` is a power of two). So a trainer and a generator of different TP degrees
agree bit for bit once the smaller degree is split up to the larger.

Dense blocks only (GQA attention + SwiGLU): an expert-TP MoE layer adds each rank's routed and
shared partials before the ranks' sum, an order a one-process MoE layer has no counterpart for.
"""

from __future__ import annotations

from torch import nn

from lockstep import numerics
from lockstep.models.common.attention import GroupedQueryAttention
from lockstep.models.common.mlp import SwiGLU


def split_row_parallel_sums(model: nn.Module, n: int) -> nn.Module:
    """Make ``model``'s row-parallel linears (the TP plan's ``attention.wo`` and ``feed_forward.w2``
    of every block) sum K in ``n`` slices in batch-invariant mode (module docstring); returns it.
    ``n = 1`` restores the plain sums. ValueError for blocks other than GQA + SwiGLU."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"split_row_parallel_sums: n must be an integer >= 1, got {n!r}")
    refusal = split_refusal(model)
    if refusal is not None:
        raise ValueError(f"split_row_parallel_sums: {refusal}")
    numerics.prepare_model(model)
    for block in model.layers.values():
        for layer in (block.attention.wo, block.feed_forward.w2):
            if n == 1:
                layer.__dict__.pop("k_split", None)
            else:
                layer.k_split = n
    return model


def split_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s sums cannot be split as another TP degree's (its first block other than GQA +
    SwiGLU), or None where :func:`split_row_parallel_sums` applies."""
    for name, block in model.layers.items():
        if type(block.attention) is not GroupedQueryAttention or type(block.feed_forward) is not SwiGLU:
            return (f"layers.{name} has {type(block.attention).__name__} + {type(block.feed_forward).__name__}; only "
                    "dense GQA + SwiGLU blocks reproduce another tensor-parallel degree's sums (docs/numerics.md)")
    return None
