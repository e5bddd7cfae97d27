"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 hybrid layers.

``x -> projections -> causal depthwise conv1d + SiLU over [q | k | v] -> L2-normed q, k ->
gated delta rule (beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)) -> RMSNorm(out) *
SiLU(z) per value head -> wo``. Parameter names follow Hugging Face's ``linear_attn`` so
checkpoints map 1:1 (``wo`` is HF's ``out_proj``):

* ``projection="split"`` (Qwen3.5): ``in_proj_qkv [2*Dk*Hk + Dv*Hv, D]``, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``.
* ``projection="grouped"`` (Qwen3-Next): ``in_proj_qkvz`` and ``in_proj_ba``, whose rows are grouped
  per key head: ``[q_h | k_h | v of its Hv/Hk value heads | z of them]`` and ``[b | a]`` likewise.

It sits in an attention slot (``layers.i.attention``) and takes the block's ``(x, rope, cache)``
call; RoPE is not used. Training runs the chunked kernel of :mod:`lockstep.models.common.delta_rule`
(``chunk_size``); with a generation cache the layer reads and writes the sequence's conv window and
delta-rule state through ``cache.recurrent_state()`` / ``cache.set_recurrent_state(conv, state)``
(:mod:`lockstep.generate.recurrent`), runs the recurrence for single-token steps, and for a
right-padded prefill (``cache.valid_lengths()``) zeroes ``g`` and ``beta`` of the padding so each
row's state stops at its last real token.

In batch-invariant mode (:mod:`lockstep.numerics`) training, prefill and decode all run
:func:`~lockstep.models.common.delta_rule.invariant_gated_delta_rule` and the conv as taps summed in
a fixed order, with the transcendentals through ``numerics.rowwise``: a token's bits are then the
same in a trainer's forward and a generator's step (docs/hybrid.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import numerics
from lockstep.compile.local import local_compile
from lockstep.config.base import require, require_choice, require_positive
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.delta_rule import (
    chunk_gated_delta_rule,
    invariant_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

PROJECTIONS = ["split", "grouped"]


@dataclasses.dataclass(kw_only=True)
class GatedDeltaNetConfig(AttentionConfig):
    """A Gated DeltaNet layer; its head counts and sizes are its own (not the model's attention's)."""

    #: query/key heads (Hugging Face ``linear_num_key_heads``)
    n_k_heads: int = 4
    #: value heads (``linear_num_value_heads``); a multiple of n_k_heads
    n_v_heads: int = 8
    #: size of each query/key head (``linear_key_head_dim``)
    k_head_dim: int = 32
    #: size of each value head (``linear_value_head_dim``)
    v_head_dim: int = 32
    #: kernel width of the causal depthwise convolution (``linear_conv_kernel_dim``)
    conv_kernel: int = 4
    #: input projection layout: "split" (Qwen3.5) or "grouped" (Qwen3-Next); see the module docstring
    projection: str = "split"
    #: tokens per chunk of the training kernel (a speed knob: any value computes the same function)
    chunk_size: int = 64

    def validate(self, path: str = "") -> None:
        p = f"{path}." if path else ""
        super().validate(path)
        for name in ("n_k_heads", "n_v_heads", "k_head_dim", "v_head_dim", "conv_kernel", "chunk_size"):
            require_positive(getattr(self, name), f"{p}{name}")
        require(self.n_v_heads % self.n_k_heads == 0, f"{p}n_v_heads",
                f"must be a multiple of n_k_heads={self.n_k_heads}, got {self.n_v_heads}")
        require_choice(self.projection, PROJECTIONS, f"{p}projection")
        require(not self.qk_norm and not self.qkv_bias, f"{p}qk_norm",
                "Gated DeltaNet has no q/k RMSNorm (it L2-normalises) and no projection bias")

    def build(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float) -> "GatedDeltaNet":
        return GatedDeltaNet(self, dim, norm_eps)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim (norm in fp32, as Hugging Face's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * numerics.rowwise(F.silu, gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """See the module docstring; ``forward(x [B, T, D], rope, cache=None) -> [B, T, D]``."""

    def __init__(self, config: GatedDeltaNetConfig, dim: int, norm_eps: float) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.n_k, self.n_v = config.n_k_heads, config.n_v_heads
        self.dk, self.dv = config.k_head_dim, config.v_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if config.projection == "grouped":
            self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(dim, 2 * self.n_v, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(dim, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(dim, self.n_v, bias=False)
            self.in_proj_a = nn.Linear(dim, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.n_v))
        self.A_log = nn.Parameter(torch.empty(self.n_v))
        self.norm = GatedRMSNorm(self.dv, norm_eps)
        self.wo = nn.Linear(self.value_dim, dim, bias=False)

    @property
    def kernel_name(self) -> str:
        """What the run manifest records as this layer's kernel."""
        return f"chunked_delta_rule(chunk_size={self.config.chunk_size})"

    def reset_parameters(self) -> None:
        """dt_bias = 1, A ~ U(0.01, 16) (Hugging Face's init); the submodules initialise themselves."""
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    def local_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(conv1d weight, A_log, dt_bias)`` of the heads this process computes: all of them here; a
        tensor-parallel plan (:mod:`lockstep.parallel.tp_blocks`) replaces this on the instance to give
        its rank's heads (and sets the head counts and widths above to its rank's)."""
        return self.conv1d.weight, self.A_log, self.dt_bias

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ``qkv [B, T, conv_dim]``, ``z [B, T, Hv, Dv]``, ``b, a [B, T, Hv]``."""
        bsz, seq, _ = x.shape
        if self.config.projection == "split":
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(bsz, seq, self.n_v, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.n_v // self.n_k
        qkvz = self.in_proj_qkvz(x).view(bsz, seq, self.n_k, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, seq, self.n_k, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([t.reshape(bsz, seq, -1) for t in (q, k, v)], dim=-1)
        return (qkv, z.reshape(bsz, seq, self.n_v, self.dv), b.reshape(bsz, seq, self.n_v),
                a.reshape(bsz, seq, self.n_v))

    def recurrent_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence generation state: conv window ``[C, K-1]`` and delta-rule state ``[Hv, Dk, Dv]``
        (:mod:`lockstep.generate.recurrent`)."""
        return (self.conv_dim, self.config.conv_kernel - 1), (self.n_v, self.dk, self.dv)

    def _conv(self, qkv: torch.Tensor, window: torch.Tensor | None, lengths: torch.Tensor | None,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU over time; ``window [B, C, K-1]`` holds the inputs before
        ``qkv`` (zeros at a sequence start). Returns the output ``[B, T, C]`` and the window after
        each row's last real token (``lengths``; all ``T`` when None)."""
        x = qkv.transpose(1, 2)
        k = self.config.conv_kernel
        if window is None:
            x = F.pad(x, (k - 1, 0))
        else:
            x = torch.cat([window.to(x.dtype), x], dim=-1)
        if numerics.is_batch_invariant():  # taps summed in a fixed order, elementwise: no conv kernel choice
            seq, w = x.shape[-1] - (k - 1), weight[:, 0].to(x.dtype)
            conv = x[:, :, :seq] * w[:, :1]
            for j in range(1, k):
                conv = conv + x[:, :, j:j + seq] * w[:, j:j + 1]
            out = numerics.rowwise(F.silu, conv.transpose(1, 2))
        else:
            out = F.silu(F.conv1d(x, weight, groups=self.conv_dim)).transpose(1, 2)
        if lengths is None:
            return out, x[:, :, x.shape[-1] - (k - 1):]
        index = (lengths[:, None] + torch.arange(k - 1, device=x.device))[:, None].expand(-1, x.shape[1], -1)
        return out, x.gather(2, index)

    def forward(self, x: torch.Tensor, rope: Any = None, cache: Any = None) -> torch.Tensor:
        invariant = numerics.is_batch_invariant()
        bsz, seq, _ = x.shape
        qkv, z, b, a = self._project(x)
        window, state = cache.recurrent_state() if cache is not None else (None, None)
        lengths = cache.valid_lengths() if cache is not None else None
        conv_weight, A_log, dt_bias = self.local_parameters()
        mixed, next_window = self._conv(qkv, window, lengths, conv_weight)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2(q.reshape(bsz, seq, self.n_k, self.dk).float(), invariant)
        k = _l2(k.reshape(bsz, seq, self.n_k, self.dk).float(), invariant)
        v = v.reshape(bsz, seq, self.n_v, self.dv)
        if self.n_v != self.n_k:  # each key head serves n_v / n_k consecutive value heads
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        beta, g = gated_deltanet_gate(b, a, A_log, dt_bias)
        if lengths is not None:  # right padding of a batched prefill: no decay, no write
            real = torch.arange(seq, device=x.device)[None] < lengths[:, None]
            g, beta = g * real[..., None], beta * real[..., None]
        if invariant:  # one construction for trainer, prefill and decode (see invariant_gated_delta_rule)
            out, state = invariant_gated_delta_rule(q, k, v, g, beta, initial_state=state)
        elif cache is not None and seq == 1:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
        else:
            out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.config.chunk_size,
                                                initial_state=state)
        if cache is not None:
            cache.set_recurrent_state(next_window, state)
        out = self.norm(out.to(x.dtype), z)
        return self.wo(out.reshape(bsz, seq, self.value_dim))


@local_compile("gated_deltanet_gate")
def gated_deltanet_gate(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The write strength ``beta = sigmoid(b)`` and the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``
    (rowwise: batch-invariant mode)."""
    beta = numerics.rowwise(torch.sigmoid, b)
    g = -numerics.rowwise(torch.exp, A_log.float()) * numerics.rowwise(F.softplus, a.float() + dt_bias)
    return beta, g


def _l2(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """L2 normalisation of the last dim (the rsqrt through ``numerics.rowwise`` when invariant)."""
    if not invariant:
        return l2_normalize(x)
    return x * numerics.rowwise(torch.rsqrt, (x * x).sum(dim=-1, keepdim=True) + 1e-6)
