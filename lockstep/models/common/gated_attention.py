"""Full attention with an output gate and partial RoPE (Qwen3-Next, Qwen3.5 full-attention layers).

Differences from :class:`~lockstep.models.common.attention.GroupedQueryAttention`:

* ``wq`` projects to twice the query width: per head, ``head_dim`` query columns then ``head_dim``
  gate columns (Hugging Face's ``q_proj`` layout, so checkpoints map 1:1 and a column split under
  tensor parallelism keeps each head's query and gate together); the attention output is
  multiplied by ``sigmoid(gate)`` before ``wo``.
* q/k norms are zero-centred RMSNorms (weight stores scale - 1) when ``zero_centered_norm``.
* RoPE rotates only the first ``rotary_dim`` of each head: the model's rotary table is built by
  :class:`PartialRopeConfig` with that width, and the rest of the head passes through.

Qwen3.5's mRoPE (``mrope_section``, interleaved) gives every text token the same temporal, height
and width position, so its cos/sin equal plain RoPE over ``rotary_dim`` (tests check this against
transformers); with images the model's rope is
:class:`lockstep.models.common.mrope.PartialMRopeConfig` (``[3, B, T]`` positions), which this layer
takes unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lockstep import numerics
from lockstep.config.base import require
from lockstep.models.common.attention import AttentionConfig, GroupedQueryAttention
from lockstep.models.common.norm import ZeroCenteredRMSNorm
from lockstep.models.common.rope import RopeConfig, RotaryEmbedding, apply_rotary


@dataclasses.dataclass(kw_only=True)
class PartialRopeConfig(RopeConfig):
    """RoPE over the first ``int(head_dim * partial_rotary_factor)`` dims of each head."""

    #: fraction of each head that is rotated (Qwen3-Next / Qwen3.5: 0.25)
    partial_rotary_factor: float = 1.0

    def validate(self, path: str = "") -> None:
        super().validate(path)
        require(0.0 < self.partial_rotary_factor <= 1.0, f"{path}.partial_rotary_factor",
                f"must be in (0, 1], got {self.partial_rotary_factor}")

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def build(self, *, head_dim: int, max_seq_len: int) -> RotaryEmbedding:
        dim = self.rotary_dim(head_dim)
        require(dim >= 2 and dim % 2 == 0, "model.rope.partial_rotary_factor",
                f"rotates {dim} of head_dim={head_dim} dims; needs an even number >= 2")
        return RotaryEmbedding(self, dim, max_seq_len)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x [B, H, T, D]; the rest pass through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


@dataclasses.dataclass(kw_only=True)
class GatedAttentionConfig(AttentionConfig):
    """GQA with per-head q/k norm, a sigmoid output gate and partial RoPE (see the module docstring)."""

    qk_norm: bool = True
    #: multiply the attention output by sigmoid(gate), the gate projected alongside the queries
    output_gate: bool = True
    #: q/k norms store scale - 1 (Qwen3-Next / Qwen3.5) instead of the scale
    zero_centered_norm: bool = True

    def build(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
              norm_eps: float) -> "GatedAttention":
        return GatedAttention(self, dim, n_heads, n_kv_heads, head_dim, norm_eps)


class GatedAttention(GroupedQueryAttention):
    """Output-gated GQA; the rope tables it is handed may cover only part of each head."""

    def __init__(self, config: GatedAttentionConfig, dim: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, norm_eps: float) -> None:
        super().__init__(config, dim, n_heads, n_kv_heads, head_dim, norm_eps)
        self.output_gate = config.output_gate
        if config.output_gate:
            self.wq = nn.Linear(dim, n_heads * head_dim * 2, bias=config.qkv_bias)
        if config.qk_norm and config.zero_centered_norm:
            self.q_norm = ZeroCenteredRMSNorm(head_dim, norm_eps)
            self.k_norm = ZeroCenteredRMSNorm(head_dim, norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        gate = None
        if self.output_gate:  # per head: [query | gate]
            q, gate = self.wq(x).view(bsz, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(bsz, seq, -1)
        else:
            q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if cache is None:
            out = self.full_attention(q, k, v, causal=True)
        else:
            out = cache.attend(q, k, v, backend=self.active_backend, scale=None)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        if gate is not None:
            out = out * numerics.rowwise(torch.sigmoid, gate)
        return self.wo(out)
