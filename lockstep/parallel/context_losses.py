"""Whole-sequence auxiliary losses and routing statistics under context parallelism.

Under cp each rank holds part of every sequence (``lockstep.parallel.context``) and
backpropagates its *part* of each loss; gradients are then summed over the cp group. A loss that
depends on whole-sequence statistics must therefore be split so that its parts sum to the
one-process value, not be computed per shard:

* MoE sequence-wise balance loss (DeepSeek-V3): ``sum_i f_i P_i`` with ``f`` the sequence's expert
  choice counts (no gradient) and ``P`` the mean routing probability over the sequence. The counts
  are all-reduced over cp first, and ``P``'s mean is this rank's token sum over the whole length:
  ``sum_r sum_i f_i (sum_{t on r} p_it / T) = sum_i f_i P_i``.
* MoE aux-loss-free bias counts: summed over cp on top of the data-parallel reduction, so every
  rank takes the same bias step from the whole batch's counts.
* DeepSeek-V3 MTP: depth ``k`` at position ``p`` needs token ``t_{p+k}`` and target ``t_{p+k+1}``,
  which may sit on another rank (the shift crosses the load-balanced chunks): ``mtp_shift`` takes
  them from the all-gathered token ids, and each depth's loss is this rank's part of the mean over
  the whole sequences (``ContextParallel.cross_entropy``).

``install_auxiliary`` sets these as the MoE layers' hooks (``sequence_loss``, ``reduce_counts``)
and the MTP model's ``mtp_context``, from outside the model; ``remove_auxiliary`` undoes it. Auxiliary losses a model records that have
no split here (a model whose ``pop_auxiliary`` would return per-shard values) are refused at install.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lockstep.config.base import ConfigError


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def sequence_balance_loss_part(scores: torch.Tensor, indices: torch.Tensor, n_experts: int, top_k: int,
                               group: dist.ProcessGroup | None, cp_size: int) -> torch.Tensor:
    """This rank's part of :func:`lockstep.models.common.moe_routing.sequence_balance_loss` over
    sequences split across the ``cp_size`` ranks of ``group`` (scores ``[B, T/cp, E]``, indices
    ``[B, T/cp, k]``); the parts of all ranks sum to the whole sequences' loss."""
    bsz, seq, _ = scores.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)
    counts = torch.zeros(bsz, n_experts, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, indices.reshape(bsz, seq * top_k),
                        torch.ones_like(indices.reshape(bsz, -1), dtype=scores.dtype))
    counts = counts.detach()  # selection counts carry no gradient (as in one process)
    dist.all_reduce(counts, group=group)
    length = seq * cp_size
    f = counts * (n_experts / (top_k * length))
    return (f * (probs.sum(dim=1) / length)).sum(dim=-1).mean()


def _summing_over(group: dist.ProcessGroup | None, inner):
    def reduce(counts: torch.Tensor) -> torch.Tensor:
        total = (inner(counts) if inner is not None else counts).detach().clone()
        dist.all_reduce(total, group=group)
        return total

    reduce.inner = inner  # what remove_auxiliary restores
    return reduce


def mtp_shift(tokens: torch.Tensor, positions: torch.Tensor, k: int, group: dist.ProcessGroup | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens at global position p + k, targets at p + k + 1 or -100 past the end, rotary positions
    p + k clamped to the sequence) for this rank's positions ``p`` [1 or B, T/cp]. The token ids of
    every rank are all-gathered (integers: cheap), so no hidden state crosses the shard boundary:
    depth k combines h_p (held here) with the embedding of t_{p+k} (from whichever rank holds it).
    Positions whose target lies past the end still run (their loss is ignored); causal attention
    keeps them from reaching the positions that count."""
    from lockstep.parallel.context import gather_sequence

    with torch.no_grad():
        full = gather_sequence(tokens, group, dim=1)  # [B, T]
    length = full.shape[1]
    where = (positions + k).expand(tokens.shape[0], -1)
    shifted = full.gather(1, where.clamp(max=length - 1))
    targets = full.gather(1, (where + 1).clamp(max=length - 1)).masked_fill(where + 1 >= length, -100)
    return shifted, targets, (positions + k).clamp(max=length - 1)


def _check_mtp(model: nn.Module) -> None:
    """MTP's tail positions (targets past the end) run through the MTP block under cp: refuse MoE
    balancing there, whose counts would include them."""
    for name, layer in model.mtp.items():
        cfg = getattr(layer.block.feed_forward, "config", None)
        if getattr(cfg, "routing", None) == "learned" and (cfg.bias_update_speed > 0 or cfg.seq_aux_loss_coef > 0):
            raise ConfigError(
                f"parallel.cp: multi-token prediction under context parallel runs mtp.{name} over every local "
                f"position, so its MoE balancing statistics would count the positions whose target lies past "
                f"the sequence end; set model.feed_forward.bias_update_speed=0 and "
                f"model.feed_forward.seq_aux_loss_coef=0, or model.mtp_loss_weight=0, or parallel.cp=1")


def install_auxiliary(model: nn.Module, context) -> None:
    """Set the cp hooks of ``context`` (a ContextParallel) on every MoE layer of ``model`` and on its
    MTP heads (see module docstring); refuses what has no whole-sequence form here."""
    group, cp_size = context.group, context.size
    if getattr(model, "mtp", None) is not None and hasattr(model, "mtp_context"):
        if model.config.mtp_loss_weight > 0:
            _check_mtp(model)
        model.mtp_context = context
    for module in model.modules():
        if hasattr(module, "sequence_loss") and hasattr(module, "reduce_counts"):
            module.sequence_loss = (lambda scores, indices, n_experts, top_k:
                                    sequence_balance_loss_part(scores, indices, n_experts, top_k, group, cp_size))
            module.reduce_counts = _summing_over(group, module.reduce_counts)


def remove_auxiliary(model: nn.Module) -> None:
    if hasattr(model, "mtp_context"):
        model.mtp_context = None
    for module in model.modules():
        if hasattr(module, "sequence_loss") and hasattr(module, "reduce_counts"):
            module.sequence_loss = None
            module.reduce_counts = getattr(module.reduce_counts, "inner", module.reduce_counts)


def report_auxiliary(losses: dict[str, torch.Tensor], group: dist.ProcessGroup | None
                     ) -> dict[str, torch.Tensor]:
    """The whole-sequence values of auxiliary-loss parts (detached): their sum over cp, one collective."""
    if not losses:
        return {}
    values = torch.stack([_local(v).detach().float() for v in losses.values()])
    dist.all_reduce(values, group=group)
    return dict(zip(losses, values.unbind()))
