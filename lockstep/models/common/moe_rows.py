"""Where an MoE layer's expert rows sit in the grouped-GEMM input on the CPU, and the capture-safe forms.

Rows sorted by expert are padded per group to a multiple of a bucket (:func:`pad_groups`; the bucket
and why: ``moe._CPU_ROW_BUCKET``), gathered, cast and padded in one pass (:class:`GatherCast`); while a
graph capture traces (``lockstep.graph.state.is_capturing()``: no host reads), the padded size is a
static upper bound (:func:`padded_rows`) whose tail is zeroed (:func:`mask_tail`) and counted as the
last expert's (:func:`row_experts`).
"""

from __future__ import annotations

import torch

from lockstep.graph.state import is_capturing


def pad_groups(x: torch.Tensor, counts: torch.Tensor,
                bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [N, D]`` grouped by ``counts`` -> ``(padded, padded_counts, rows)``: each group followed by
    zero rows up to a multiple of ``bucket``; ``padded[rows]`` is ``x``. Zero rows add exact zeros to
    the weight gradients and the rows' own results do not depend on the row count (a test pins this
    bitwise), so the padding changes only speed."""
    padded_counts, rows, total = pad_positions(counts, bucket, x.shape[0])
    padded = x.new_zeros(total, x.shape[1]).index_copy(0, rows, x)
    return padded, padded_counts, rows


def pad_positions(counts: torch.Tensor, bucket: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(padded_counts, rows, total)`` of :func:`pad_groups` for ``n`` rows grouped by ``counts``:
    row ``i`` goes to ``rows[i]`` of a ``total``-row padded input."""
    padded_counts = (counts + bucket - 1) // bucket * bucket
    expert = row_experts(counts, None, n, padded=False)
    shift = (padded_counts.cumsum(0) - padded_counts) - (counts.cumsum(0) - counts)
    rows = torch.arange(n, device=counts.device) + shift[expert]
    return padded_counts, rows, padded_rows(counts, padded_counts, bucket, n)


class GatherCast(torch.autograd.Function):
    """``x [N, D]`` -> ``x.to(dtype)[src]``, rows with ``src == N`` zero: the gather by token, the cast
    and the padding of :func:`pad_groups` in one pass over the padded rows (casting the ``N`` inputs
    before gathering their ``k N`` copies). Backward sums each row's gradient, cast to ``x``'s dtype,
    into its token with ``index_add_`` in row order: the same values, added in the same order, as the
    gather -> cast -> pad it replaces (a test pins forward and backward bitwise)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(src)
        ctx.n, ctx.in_dtype = x.shape[0], x.dtype
        low = x.to(dtype)
        return torch.cat([low, low.new_zeros(1, x.shape[1])]).index_select(0, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (src,) = ctx.saved_tensors
        acc = grad.new_zeros(ctx.n + 1, grad.shape[1], dtype=ctx.in_dtype)
        return acc.index_add_(0, src, grad.to(ctx.in_dtype))[:ctx.n], None, None


def padded_rows(counts: torch.Tensor, padded_counts: torch.Tensor, bucket: int, n: int) -> int:
    """Rows of the padded input: the groups' padded total, read on the host; while a graph capture
    traces (no host reads), its static upper bound instead -- the groups keep their exact padded sizes
    and the rows past the last group are left to :func:`mask_tail` (so each group's matmuls, and the
    weight gradients, are the same as eager's)."""
    if is_capturing():
        return (n + counts.shape[0] * (bucket - 1)) // bucket * bucket
    return int(padded_counts.sum())


def mask_tail(t: torch.Tensor, offs: torch.Tensor, padded: bool) -> torch.Tensor:
    """Zero the rows past the last group (``torch._grouped_mm`` leaves them unwritten); they exist only
    in a padded input (``padded``) under a capture."""
    if not (padded and is_capturing()):
        return t
    valid = torch.arange(t.shape[0], device=t.device) < offs[-1]
    return torch.where(valid.unsqueeze(1), t, torch.zeros((), dtype=t.dtype, device=t.device))


def row_experts(counts: torch.Tensor, offs: torch.Tensor | None, n: int, padded: bool) -> torch.Tensor:
    """Each of the ``n`` (padded) rows' expert; under a capture the rows past the last group (masked to
    zero by :func:`mask_tail`, so they add exact zeros to the last expert's bias gradient) count as
    the last expert's."""
    if not (padded and is_capturing()):
        return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=n)
    rows = torch.arange(n, device=counts.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True).clamp(max=counts.shape[0] - 1)
