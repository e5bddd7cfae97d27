"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed long-range entries.

Per block (transformers' ``DeepseekV4Attention``):

* queries from a low-rank path (``q_a_proj`` -> RMSNorm -> ``q_b_proj``), each head RMS-normed
  without a weight; one key=value head (``kv_proj`` -> RMSNorm), read as both key and value;
* partial interleaved RoPE on the trailing ``rope_dim`` channels (``main_rope`` for pure
  sliding-window blocks, ``compress_rope`` -- another theta, YaRN in the released models -- for
  CSA/HCA blocks); the output's rope channels are
  rotated back by ``-position`` so each value's contribution depends on relative distance only;
* keys: the last ``sliding_window`` tokens (causal) plus, in CSA/HCA blocks, the compressed entries
  of :class:`~lockstep.models.common.kv_compressor.KVCompressor` (HCA: every causal entry; CSA: the
  ``topk`` the :class:`~lockstep.models.common.kv_compressor.CompressedIndexer` picks);
* a learned per-head attention sink (a logit with no value, as GPT-OSS);
* grouped low-rank output: heads split into ``o_groups`` groups, each projected by its own block
  of ``o_a_proj`` to ``o_lora_rank``, then mixed by ``o_b_proj``.

Computed eagerly (scores materialised, fp32 softmax): the kernels in :mod:`lockstep.ops.attention`
take neither compressed keys nor sinks with per-query key sets. Generation hands ``forward`` a cache
(:mod:`lockstep.generate.compressed_cache`) that keeps the window's keys and the compressed entries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.models.common.hyper_connections import unweighted_rms_norm
from lockstep.models.common.kv_compressor import (
    CompressedIndexer,
    KVCompressor,
    apply_interleaved_rope,
    causal_entries,
    rope_cos_sin,
)
from lockstep.models.common.norm import RMSNorm
from lockstep.models.common.rope_yarn import YarnRopeConfig

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


class GroupedLinear(nn.Module):
    """Block-diagonal linear: ``x [..., G, I] -> [..., G, O/G]``, weight ``[O, I]`` stacked by group."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.n_groups, -1, x.shape[-1])
        return torch.einsum("...gi,goi->...go", x, w)


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention block of ``layer_type`` (see the module docstring)."""

    def __init__(self, *, dim: int, n_heads: int, head_dim: int, rope_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, sliding_window: int, layer_type: str, rate: int, main_rope: YarnRopeConfig,
                 compress_rope: YarnRopeConfig, norm_eps: float, index_n_heads: int = 0, index_head_dim: int = 0,
                 index_topk: int = 0) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.o_groups, self.sliding_window, self.layer_type, self.rate = o_groups, sliding_window, layer_type, rate
        self.rope = main_rope if layer_type == "sliding_attention" else compress_rope
        self.norm_eps = norm_eps
        self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, norm_eps)
        self.o_a_proj = GroupedLinear(n_heads * head_dim // o_groups, o_groups * o_lora_rank, o_groups)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.compressor: KVCompressor | None = None
        self.indexer: CompressedIndexer | None = None
        if layer_type != "sliding_attention":
            sparse = layer_type == "compressed_sparse_attention"
            self.compressor = KVCompressor(dim, head_dim, rate, sparse, rope_dim, compress_rope, norm_eps)
            if sparse:
                self.indexer = CompressedIndexer(dim, q_lora_rank, index_n_heads, index_head_dim, index_topk, rate,
                                                 rope_dim, compress_rope, norm_eps)
        self.init_std = 0.02
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.sinks)
        nn.init.normal_(self.o_a_proj.weight, std=self.init_std)

    def cached_compressors(self) -> dict[str, KVCompressor]:
        """The compressors whose state a generation cache keeps, by the names :meth:`forward` hands
        the cache (``"compressor"``; CSA also ``"indexer"``); empty for a pure sliding-window block."""
        named = {"compressor": self.compressor} if self.compressor is not None else {}
        if self.indexer is not None:
            named["indexer"] = self.indexer.compressor
        return named

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """``x [B, T, D]`` at ``positions [1 or B, T]`` -> ``[B, T, D]``. Without ``cache``: whole
        sequences from position 0. With a generation ``cache``: each row's new tokens at ``positions``;
        the cache adds its kept sliding-window keys (``cache.window_keys``) and compressed entries
        (:meth:`KVCompressor.cached`)."""
        batch, seq, _ = x.shape
        pos = positions.expand(batch, -1)
        cos, sin = rope_cos_sin(pos, self.rope, self.rope_dim)
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        q = apply_interleaved_rope(unweighted_rms_norm(q, self.norm_eps), cos, sin)
        kv = apply_interleaved_rope(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin)  # [B, 1, T, K]
        if cache is None:
            distance = pos.unsqueeze(-1) - pos.unsqueeze(-2)  # [B, T, T] query minus key
            allowed = (distance >= 0) & (distance < self.sliding_window)
        else:
            keys, allowed = cache.window_keys(kv.squeeze(1), self.sliding_window)
            kv = keys.unsqueeze(1)
        if self.compressor is not None:
            compressed = self.compressor(x) if cache is None else self.compressor.cached(x, cache, "compressor")
            if self.indexer is None:
                picked = causal_entries(pos, compressed.shape[1], self.rate)
            elif cache is None:
                picked = self.indexer(x, q_latent, positions)
            else:
                picked = self.indexer.cached(x, q_latent, pos, cache)
            kv = torch.cat([kv, compressed.unsqueeze(1)], dim=2)
            allowed = torch.cat([allowed, picked], dim=-1)
        scores = torch.matmul(q, kv.transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(batch, -1, seq, 1)
        probs = torch.cat([scores, sinks], dim=-1).float().softmax(dim=-1)[..., :-1].to(kv.dtype)
        out = apply_interleaved_rope(torch.matmul(probs, kv), cos, -sin)  # [B, H, T, K]
        grouped = out.transpose(1, 2).reshape(batch, seq, self.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped).flatten(2))


__all__ = ["CompressedAttention", "GroupedLinear", "LAYER_TYPES"]
