"""Mixture-of-experts routing math, kept as pure functions so it can be tested against hand values.

``route`` implements the router of Qwen3-MoE / DeepSeek-V3 (``transformers``' ``Qwen3MoeTopKRouter``
and ``DeepseekV3TopkRouter``): score every expert (softmax or sigmoid of the router logits, in
fp32), optionally restrict the choice to the best ``topk_group`` of ``n_group`` expert groups, add
the aux-loss-free balancing bias for *selection only*, take the top k, and weight each chosen expert
by its *unbiased* score (renormalised over the chosen k if asked, then scaled). ``topk_softmax``
(GPT-OSS's ``GptOssTopKRouter``) picks the top k logits and weights them by a softmax over those k.
"""

from __future__ import annotations

import torch

from lockstep import numerics
from lockstep.compile.local import local_compile


def expert_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-expert affinity in fp32: softmax over experts, or an independent sigmoid per expert."""
    logits = logits.float()
    if score_func in ("softmax", "topk_softmax"):
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return numerics.rowwise(torch.sigmoid, logits)
    raise ValueError(f"score_func must be 'softmax', 'topk_softmax' or 'sigmoid', got {score_func!r}")


@local_compile("moe_router")
def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits [N, E]``: returns ``(weights [N, k] fp32, indices [N, k], scores [N, E])``.

    ``bias`` (the DeepSeek-V3 ``e_score_correction_bias``) is added to the scores only to *choose*
    experts; the returned weights are gathered from the unbiased scores. With ``n_group > 1`` each
    token first picks its ``topk_group`` best groups, a group scored by the sum of its two best
    (biased) expert scores (its best one if a group holds a single expert), as DeepSeek-V3 does;
    experts outside those groups cannot be chosen.
    """
    scores = expert_scores(logits, score_func)
    if score_func == "topk_softmax":  # GPT-OSS: top-k of the logits, softmax over those k only
        choice = logits.float() if bias is None else logits.float() + bias.float()
        indices = choice.topk(top_k, dim=-1).indices
        weights = logits.float().gather(1, indices).softmax(dim=-1)
        return weights * routed_scaling_factor if routed_scaling_factor != 1.0 else weights, indices, scores
    choice = scores if bias is None else scores + bias.float()
    n_tokens, n_experts = choice.shape
    if n_group > 1:
        per_group = n_experts // n_group
        grouped = choice.view(n_tokens, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(n_tokens, n_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, indices, scores


def forced_balanced_indices(n_tokens: int, top_k: int, n_experts: int, device: torch.device) -> torch.Tensor:
    """Round-robin assignment ignoring scores: token t takes experts (t*k + j) mod E, j < k.

    The k experts of a token are distinct (k <= E) and every expert receives exactly
    ``n_tokens * k / E`` assignments whenever that is an integer (at most one more otherwise).
    For benchmarking the expert computation under perfect balance, never for training a model.
    """
    base = torch.arange(n_tokens, device=device).unsqueeze(1) * top_k
    return (base + torch.arange(top_k, device=device)) % n_experts


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (unweighted), averaged over the batch.

    ``scores [B, T, E]`` are the unbiased router scores, ``indices [B, T, k]`` the chosen experts.
    Per sequence: f_i = E / (k T) * (tokens choosing i), P_i = mean_t s_it / sum_j s_jt, loss =
    sum_i f_i P_i. A perfectly balanced sequence with uniform scores gives exactly 1.
    """
    bsz, seq, _ = scores.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)
    p = probs.mean(dim=1)  # [B, E]
    counts = torch.zeros(bsz, n_experts, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, indices.reshape(bsz, seq * top_k), torch.ones_like(indices.reshape(bsz, -1), dtype=scores.dtype))
    f = counts * (n_experts / (top_k * seq))
    return (f * p).sum(dim=-1).mean()


def load_stats(counts: torch.Tensor) -> torch.Tensor:
    """``[min, max, coefficient of variation]`` of the tokens each expert received (one tensor,
    so reading it costs one device sync). CV is std/mean with the population std (0 = balanced)."""
    c = counts.float()
    mean = c.mean()
    cv = c.std(correction=0) / mean.clamp_min(1e-12)
    return torch.stack([c.min(), c.max(), cv])


@torch.no_grad()
def balance_bias_update(bias: torch.Tensor, counts: torch.Tensor, speed: float) -> None:
    """DeepSeek-V3 aux-loss-free balancing, in place: b_i += speed * sign(mean load - load_i).

    Overloaded experts are pushed down, underloaded ones up; an expert exactly at the mean keeps
    its bias. Runs outside autograd and only touches the selection bias, never the weights.
    """
    c = counts.to(torch.float32)
    bias.add_((speed * torch.sign(c.mean() - c)).to(bias.dtype))
