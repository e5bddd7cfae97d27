"""Grouped-query attention with optional per-head q/k RMSNorm (Qwen3), backend chosen by name.

Optional, for GPT-OSS: q/k/v and output biases, learned per-head attention sinks (a logit in every
softmax denominator that attends to nothing) and a sliding window (a query sees its last
``sliding_window`` keys, itself included); the backends implement both (:mod:`lockstep.ops.attention`).

``forward(x, rope, cache=None)``: without a cache (training, scoring) attention is causal over ``x``'s
own tokens. With a cache (generation, :mod:`lockstep.generate`) ``x`` holds only the new tokens of
each sequence; the cache stores their keys/values and attends over each sequence's whole context
with the KV-cache variant of this layer's backend. How the layer's kernel is found (configured name,
batch-invariant switch, wrappers such as context parallelism): :mod:`lockstep.ops.attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep.config.base import Config, require, require_choice
from lockstep.models.common.norm import RMSNorm
from lockstep.models.common.rope import apply_rotary
from lockstep.ops.attention import AttentionLayer, attention_backends, sink_window_kwargs


@dataclasses.dataclass(kw_only=True)
class AttentionConfig(Config):
    """Self-attention block; overrides may swap the backend per layer."""

    slot_kind: ClassVar[type]

    #: attention kernel: "sdpa" (PyTorch scaled_dot_product_attention) or "reference"
    backend: str = "sdpa"
    #: RMSNorm each query/key head before RoPE (Qwen3)
    qk_norm: bool = False
    #: add a bias to the q/k/v projections (Qwen2-style checkpoints)
    qkv_bias: bool = False
    #: add a bias to the output projection (GPT-OSS)
    o_bias: bool = False
    #: a learned per-head sink logit in every softmax denominator (GPT-OSS)
    sinks: bool = False
    #: 0: full causal attention; n > 0: each query sees only its last n keys, itself included
    sliding_window: int = 0

    def validate(self, path: str = "") -> None:
        require_choice(self.backend, attention_backends(), f"{path}.backend")
        require(self.sliding_window >= 0, f"{path}.sliding_window", f"must be >= 0, got {self.sliding_window}")

    def build(
        self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float
    ) -> "GroupedQueryAttention":
        return GroupedQueryAttention(self, dim, n_heads, n_kv_heads, head_dim, norm_eps)


AttentionConfig.slot_kind = AttentionConfig


class GroupedQueryAttention(AttentionLayer):
    """Multi-head attention where groups of query heads share one key/value head."""

    def __init__(
        self,
        config: AttentionConfig,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        norm_eps: float,
    ) -> None:
        super().__init__(config.backend)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=config.o_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if config.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if config.sinks else None
        self.window = config.sliding_window

    def reset_parameters(self) -> None:
        """Sinks start at logit 0 (the linears are initialised by the model)."""
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def local_sinks(self) -> torch.Tensor | None:
        """The sinks of the heads this process computes: all of them here; a tensor-parallel plan
        (:mod:`lockstep.parallel.tp_blocks`) replaces this on the instance to give its rank's heads."""
        return self.sinks

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any = None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; ``cache``: a layer cache (``attend(q, k, v, backend=, scale=)``)."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            out = self.full_attention(q, k, v, causal=True, sinks=self.local_sinks(), window=self.window)
        else:
            out = cache.attend(q, k, v, backend=self.active_backend, scale=None,
                               **sink_window_kwargs(self.local_sinks(), self.window))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
