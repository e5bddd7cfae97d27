"""DeepSeek-V4's KV compressors and its compressed lightning indexer (paper sections 2.3.1-2.3.2).

A :class:`KVCompressor` turns every window of ``rate`` tokens into one key=value entry: a softmax
(over the window, per channel) of gate scores plus a learned per-slot ``position_bias`` weighs the
projected tokens, the sum is RMS-normed and rotated (interleaved RoPE on its trailing ``rope_dim``
channels, the compressed branches' rope: plain or YaRN) at the window's first position. Two kinds:

* heavily compressed (HCA, ``overlap=False``): disjoint windows;
* compressed sparse (CSA, ``overlap=True``): projections are ``2 * head_dim`` wide, entry ``w``
  pools window ``w-1``'s first half with window ``w``'s second half (width ``2 * rate``, stride
  ``rate``); the first window has no predecessor (its slots get weight 0).

Entry ``w`` covers tokens ``[w*rate, (w+1)*rate)``: query ``t`` may read it once ``w < (t+1) // rate``.
:class:`CompressedIndexer` (CSA only) runs its own small overlapping compressor, scores each query
against the compressed keys (``sum_h w_h * relu(q_h . k)``) and keeps the ``topk`` best causal
entries. Trailing tokens that do not fill a window are not compressed (a training forward of the
whole sequence, as transformers' cache-less path does). Names follow transformers'
``DeepseekV4{HCA,CSA}Compressor`` / ``DeepseekV4Indexer``.

Generation (``cached``): the engine's cache (:mod:`lockstep.generate.compressed_cache`) keeps each
sequence's recent projections and its entries; both paths pool with :meth:`KVCompressor.pool`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.models.common.norm import RMSNorm
from lockstep.models.common.rope_yarn import YarnRopeConfig


def rope_cos_sin(positions: torch.Tensor, rope: YarnRopeConfig, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved-RoPE tables ``[..., rope_dim // 2]`` (one angle per channel pair) at ``positions``:
    ``rope``'s frequencies (plain or YaRN) and cos/sin factor, computed as transformers does."""
    inv_freq = rope.inverse_frequencies(rope_dim).to(positions.device)
    freqs = positions[..., None].float() * inv_freq
    factor = rope.cos_sin_factor()
    return freqs.cos() * factor, freqs.sin() * factor


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x [B, H, T, D]`` as interleaved pairs
    (``cos``/``sin`` ``[B, T, R/2]``), in fp32; the leading channels pass through."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class KVCompressor(nn.Module):
    """One compressed KV entry per window of ``rate`` tokens (see the module docstring)."""

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, rope_dim: int, rope: YarnRopeConfig,
                 norm_eps: float) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap, self.rope_dim, self.rope = head_dim, rate, overlap, rope_dim, rope
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(dim, width, bias=False)
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = RMSNorm(head_dim, norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.position_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [B, T, D]`` -> compressed entries ``[B, T // rate, head_dim]`` (rotated)."""
        batch, rate = h.shape[0], self.rate
        n_windows = h.shape[1] // rate
        usable = h[:, : n_windows * rate]
        if n_windows == 0:
            return h.new_zeros((batch, 0, self.head_dim))
        kv = self.kv_proj(usable).view(batch, n_windows, rate, -1)
        gate = self.gate_proj(usable).view(batch, n_windows, rate, -1)
        prev_kv = prev_gate = None
        if self.overlap:  # window w-1 of each window w; the first has none (gate -inf: weight 0)
            prev_kv = F.pad(kv[:, :-1], (0, 0, 0, 0, 1, 0))
            prev_gate = F.pad(gate[:, :-1], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        windows = torch.arange(n_windows, device=h.device).unsqueeze(0).expand(batch, -1)
        return self.pool(kv, gate, windows, prev_kv, prev_gate)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, windows: torch.Tensor, prev_kv: torch.Tensor | None = None,
             prev_gate: torch.Tensor | None = None) -> torch.Tensor:
        """One entry per window: ``kv``/``gate [B, W, rate, width]`` the projections of windows
        ``windows [B, W]`` (before ``position_bias``); overlap: ``prev_kv``/``prev_gate`` those of each
        window's predecessor (gate ``-inf`` where there is none) -> ``[B, W, head_dim]`` (rotated)."""
        hd = self.head_dim
        gate = gate + self.position_bias
        if self.overlap:  # slots [0, rate): previous window's first half; [rate, 2 rate): this one's second
            prev_gate = prev_gate + self.position_bias
            kv = torch.cat([prev_kv[..., :hd], kv[..., hd:]], dim=2)
            gate = torch.cat([prev_gate[..., :hd], gate[..., hd:]], dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        compressed = self.kv_norm(pooled)
        cos, sin = rope_cos_sin(windows * self.rate, self.rope, self.rope_dim)
        return apply_interleaved_rope(compressed.unsqueeze(1), cos, sin).squeeze(1)

    def cached(self, h: torch.Tensor, cache: Any, name: str) -> torch.Tensor:
        """Generation: ``h [B, T, D]`` are each row's new tokens. The cache hands back the windows
        they complete (with the earlier tokens it kept) and, once they are pooled, stores the new
        entries and returns every entry of each row's context so far ``[B, C, head_dim]``
        (``cache.compressor_windows`` / ``cache.store_entries``; :mod:`lockstep.generate.compressed_cache`)."""
        windows = cache.compressor_windows(name, self.kv_proj(h), self.gate_proj(h), self.rate, self.overlap)
        entries = self.pool(windows.kv, windows.gate, windows.ids, windows.prev_kv, windows.prev_gate)
        return cache.store_entries(name, entries, windows)


def causal_entries(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """``[B, T, n_entries]`` bool: entry ``w`` is complete before query position ``t``."""
    threshold = (positions + 1) // rate
    return torch.arange(n_entries, device=positions.device).view(1, 1, -1) < threshold.unsqueeze(-1)


class IndexerScorer(nn.Module):
    """Per-query head weights of the indexer score (transformers' ``DeepseekV4IndexerScorer``)."""

    def __init__(self, dim: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.softmax_scale, self.weights_scaling = head_dim ** -0.5, n_heads ** -0.5
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``q [B, T, H, K]``, ``keys [B, C, K]``, ``h [B, T, D]`` -> scores ``[B, T, C]`` (fp32)."""
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.softmax_scale
        weights = self.weights_proj(h).float() * self.weights_scaling
        return (scores * weights.unsqueeze(-1)).sum(dim=2)


class CompressedIndexer(nn.Module):
    """Picks each query's ``topk`` compressed entries (CSA); its choice is not differentiable."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, rate: int,
                 rope_dim: int, rope: YarnRopeConfig, norm_eps: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.rate = n_heads, head_dim, topk, rate
        self.rope_dim, self.rope = rope_dim, rope
        self.compressor = KVCompressor(dim, head_dim, rate, True, rope_dim, rope, norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(dim, n_heads, head_dim)

    def forward(self, h: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Allowed entries ``[B, T, C]`` (bool) for ``C = T // rate`` compressed entries."""
        return self.select(h, q_latent, positions, self.compressor(h))

    def cached(self, h: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """Generation: the allowed entries ``[B, T, C]`` over each row's cached indexer keys (the new
        tokens at ``positions [B, T]``; :meth:`KVCompressor.cached` under the name ``"indexer"``)."""
        return self.select(h, q_latent, positions, self.compressor.cached(h, cache, "indexer"))

    def select(self, h: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
        """The ``topk`` best causal entries of ``keys [B, C, K]`` for each query (``[B, T, C]`` bool)."""
        batch, seq = h.shape[:2]
        n_entries = keys.shape[1]
        causal = causal_entries(positions.expand(batch, -1), n_entries, self.rate)
        if n_entries == 0:
            return causal
        q = self.q_b_proj(q_latent).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions.expand(batch, -1), self.rope, self.rope_dim)
        q = apply_interleaved_rope(q, cos, sin).transpose(1, 2)
        scores = self.scorer(q, keys, h).masked_fill(~causal, float("-inf"))
        chosen = scores.topk(min(self.topk, n_entries), dim=-1).indices
        picked = torch.zeros_like(causal).scatter_(-1, chosen, True)
        return picked & causal


def indexer_param_count(dim: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int) -> int:
    """Parameters of one :class:`CompressedIndexer`."""
    return compressor_param_count(dim, head_dim, rate, True) + q_lora_rank * n_heads * head_dim + dim * n_heads


def compressor_param_count(dim: int, head_dim: int, rate: int, overlap: bool) -> int:
    width = 2 * head_dim if overlap else head_dim
    return 2 * dim * width + rate * width + head_dim


__all__ = ["CompressedIndexer", "KVCompressor", "apply_interleaved_rope", "causal_entries", "compressor_param_count",
           "indexer_param_count", "rope_cos_sin"]
