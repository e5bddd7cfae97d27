"""DeepSeek-V4's MoE routing: ``sqrt(softplus)`` scores, learned top-k or frozen hash routing.

:class:`RoutedMoE` is :class:`lockstep.models.common.moe.MoE` (same grouped experts, shared experts,
load metrics and aux-loss-free bias) with V4's router and activations:

* scores ``sqrt(softplus(logits))`` (fp32); the chosen k weights are renormalised and multiplied
  by ``routed_scaling_factor`` (transformers' ``DeepseekV4TopKRouter``);
* ``hash=True`` (the first layers, paper section 2.1): the experts come from a frozen table
  ``tid2eid[token id]`` (a persistent buffer, shipped in the checkpoint), the weights still from the
  learned scores (``DeepseekV4HashRouter``); the forward then needs the token ids;
* routed and shared experts use SwiGLU with ``gate`` clamped above and ``up`` clamped on both sides
  at ``swiglu_limit`` (:func:`limited_swiglu`).

The table of a freshly initialised model is round-robin (``tid2eid[t, j] = (t*k + j) mod E``); a
checkpoint's table replaces it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lockstep.models.common.moe import MoE, MoEConfig


def limited_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (DeepSeek-V4's expert activation)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def sqrt_softplus_route(logits: torch.Tensor, top_k: int, routed_scaling_factor: float,
                        bias: torch.Tensor | None = None, chosen: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights [N, k], indices [N, k], scores [N, E])``: ``chosen`` (hash routing) fixes the
    experts, else the top k of ``scores + bias``; weights are the renormalised unbiased scores."""
    scores = F.softplus(logits.float()).sqrt()
    if chosen is None:
        choice = scores if bias is None else scores + bias.float()
        chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, chosen, scores


class RoutedMoE(MoE):
    """V4's MoE block (see the module docstring); ``forward(x, tokens)``."""

    def __init__(self, config: MoEConfig, dim: int, hidden_dim: int, vocab_size: int, hash_routed: bool,
                 swiglu_limit: float) -> None:
        super().__init__(config, dim, hidden_dim)
        self.hash_routed, self.swiglu_limit = hash_routed, swiglu_limit
        self.experts.activation = functools.partial(limited_swiglu, limit=swiglu_limit)
        if hash_routed:
            self.register_buffer("tid2eid", torch.empty(vocab_size, self.top_k, dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "hash_routed", False):
            rows = torch.arange(self.tid2eid.shape[0], device=self.tid2eid.device).unsqueeze(1) * self.top_k
            self.tid2eid.copy_((rows + torch.arange(self.top_k, device=rows.device)) % self.n_experts)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(flat.float(), self.gate.weight.float())
        chosen = None
        if self.hash_routed:
            if tokens is None:
                raise ValueError("RoutedMoE: a hash-routed layer needs the token ids")
            chosen = self.tid2eid[tokens.reshape(-1)]
        weights, indices, scores = sqrt_softplus_route(logits, self.top_k, self.config.routed_scaling_factor,
                                                       self.e_score_correction_bias, chosen)
        counts = torch.bincount(indices.reshape(-1), minlength=self.n_experts)
        out = self.routed_and_shared(flat, flat, weights, indices, counts)
        self._record(counts, None if self.hash_routed else scores, indices, shape)
        return out.view(shape)

    def shared_output(self, flat: torch.Tensor) -> torch.Tensor | None:
        s = self.shared_experts
        return s.w2(limited_swiglu(s.w1(flat), s.w3(flat), self.swiglu_limit))


__all__ = ["RoutedMoE", "limited_swiglu", "sqrt_softplus_route"]
