"""Multi-head latent attention (MLA), DeepSeek-V2/V3 and Kimi-K2.

Queries come from ``wq(x)``, or through a low-rank bottleneck ``wq_b(q_norm(wq_a(x)))`` when
``q_lora_rank > 0``. Keys and values share one compressed latent: ``wkv_a(x)`` gives
``c_kv`` (``kv_lora_rank`` wide) and a single rotary key ``k_pe`` (``qk_rope_head_dim`` wide, shared
by all heads); ``wkv_b(kv_norm(c_kv))`` expands the latent into per-head ``k_nope`` and ``v``. RoPE
is *decoupled*: it rotates only ``q_pe`` and ``k_pe``; a head's key is ``[k_nope, k_pe]`` and its
query ``[q_nope, q_pe]``. The softmax scale is ``softmax_mscale / sqrt(qk_nope_head_dim +
qk_rope_head_dim)`` where DeepSeek's YaRN sets ``softmax_mscale = get_mscale(factor,
mscale_all_dim) ** 2``.

Layout of the rotary dims: DeepSeek checkpoints rotate *interleaved* pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave=True``, as HF's default). Like transformers' ``apply_rotary_pos_emb_interleave``
this gathers the even then the odd dims of ``q_pe``/``k_pe`` and rotates the result in the
half-rotation layout; q and k are permuted alike, so the scores equal those of pairwise rotation.

Generation (``forward(..., cache=...)``) caches the compressed latent, as DeepSeek-V3 inference
does: per token ``[kv_norm(c_kv), rotated k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` wide, shared
by every head) instead of per-head keys and values. ``wkv_b`` is absorbed into the query and the
output ("weight absorption"): ``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and ``sum_s p_s W_uv c_s =
W_uv sum_s p_s c_s``, so attention runs over the latent as multi-query attention with one shared
key/value head (keys ``[c, k_pe]``, values ``c``) and the same softmax scale. This is the same function
as the full path up to float summation order.

The rope tables passed in must be built for ``qk_rope_head_dim`` (the DeepSeek family's
``TransformerConfig`` does this by reporting ``qk_rope_head_dim`` as its head size).

DeepSeek-V3.2 (``indexer`` set): a :class:`~lockstep.models.common.sparse_indexer.SparseIndexer`
picks each query's top-k keys from the query latent and the hidden states, and the attention runs
over those keys only (an explicit mask on the backend's full-sequence kernel; the latent path of
generation passes it to ``attend_latent``, with the indexer's keys cached beside the latent).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from lockstep import numerics
from lockstep.config.base import require, require_choice, require_positive
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.norm import RMSNorm
from lockstep.models.common.rope import apply_rotary
from lockstep.models.common.sparse_indexer import SparseIndexerConfig, causal_allowed
from lockstep.ops.attention import AttentionLayer, attention_backends, get_attention, position_mask


@dataclasses.dataclass(kw_only=True)
class MLAConfig(AttentionConfig):
    """Multi-head latent attention; an attention kind, so overrides may swap its backend per layer.

    ``qkv_bias`` means HF's ``attention_bias``: a bias on ``wq_a``, ``wkv_a`` and ``wo``.
    ``qk_norm`` is not supported (MLA normalises its latents instead).
    """

    #: rank of the query bottleneck; 0 projects queries directly (no q compression)
    q_lora_rank: int = 0
    #: width of the compressed key/value latent c_kv
    kv_lora_rank: int = 512
    #: per-head query/key dims without rotary embedding
    qk_nope_head_dim: int = 128
    #: per-head query dims (and shared key dims) carrying the rotary embedding
    qk_rope_head_dim: int = 64
    #: per-head value dims
    v_head_dim: int = 128
    #: rotate interleaved pairs of rotary dims (DeepSeek/HF checkpoints); False: half-rotation
    rope_interleave: bool = True
    #: multiplier of the 1/sqrt(qk head dim) softmax scale; 0 = derive from the model's rope
    #: (YaRN: get_mscale(factor, mscale_all_dim)^2; 1 without YaRN)
    softmax_mscale: float = 0.0
    #: epsilon of the q and kv latent RMSNorms (DeepSeek uses 1e-6 whatever the model's norm_eps)
    latent_norm_eps: float = 1e-6
    #: DeepSeek-V3.2's sparse-attention indexer (top-k keys per query); None: dense MLA
    indexer: SparseIndexerConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, path: str = "") -> None:
        require_choice(self.backend, attention_backends(), f"{path}.backend")
        require(not self.qk_norm, f"{path}.qk_norm", "is not supported by MLA (its latents are normalised)")
        require(self.q_lora_rank >= 0, f"{path}.q_lora_rank",
                f"must be >= 0 (0 = no q compression), got {self.q_lora_rank}")
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "latent_norm_eps"):
            require_positive(getattr(self, name), f"{path}.{name}")
        require(self.qk_nope_head_dim >= 0, f"{path}.qk_nope_head_dim", f"must be >= 0, got {self.qk_nope_head_dim}")
        require(self.qk_rope_head_dim % 2 == 0, f"{path}.qk_rope_head_dim",
                f"must be even, got {self.qk_rope_head_dim}")
        require(self.softmax_mscale >= 0, f"{path}.softmax_mscale",
                f"must be >= 0 (0 = from rope), got {self.softmax_mscale}")
        if self.indexer is not None:
            require(self.q_lora_rank > 0, f"{path}.q_lora_rank", "must be > 0 with an indexer (it reads the q latent)")
            require(self.indexer.head_dim >= self.qk_rope_head_dim, f"{path}.indexer.head_dim",
                    f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}, got {self.indexer.head_dim}")
            self.indexer.validate(f"{path}.indexer")

    def build(
        self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float
    ) -> "MultiHeadLatentAttention":
        # head_dim is the rope table width the model built; MLA's own head sizes come from this config.
        if n_kv_heads != n_heads:
            raise ValueError(f"MLA expands keys/values for every head: n_kv_heads ({n_kv_heads}) "
                             f"must equal n_heads ({n_heads})")
        if head_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"MLA needs rope tables of qk_rope_head_dim={self.qk_rope_head_dim}, the model built {head_dim}"
            )
        return MultiHeadLatentAttention(self, dim, n_heads)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] over the last dim."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiHeadLatentAttention(AttentionLayer):
    """x [B, T, dim], rope (cos, sin) [B or 1, T, qk_rope_head_dim] -> [B, T, dim]."""

    def __init__(self, config: MLAConfig, dim: int, n_heads: int) -> None:
        super().__init__(config.backend)
        self.config = config
        self.n_heads = n_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = config.qk_head_dim, config.v_head_dim
        self.scale = (config.softmax_mscale or 1.0) / math.sqrt(self.qk_head_dim)
        bias = config.qkv_bias
        if self.q_lora_rank:
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(self.q_lora_rank, config.latent_norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(self.kv_lora_rank, config.latent_norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * self.v_head_dim, dim, bias=bias)
        self.indexer = (config.indexer.build(dim=dim, q_lora_rank=self.q_lora_rank, rope_dim=self.qk_rope_head_dim)
                        if config.indexer is not None else None)

    def absorbed_kv_weight(self) -> torch.Tensor:
        """``wkv_b``'s weight as the absorbed path multiplies by it: all heads here; a tensor-parallel
        plan (:mod:`lockstep.parallel.tp_blocks`) replaces this on the instance to give its rank's heads."""
        return self.wkv_b.weight

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any = None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; ``cache``: a latent layer cache (``attend_latent``), see the module doc."""
        bsz, seq, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x)) if self.q_lora_rank else None
        q = self.wq_b(q_latent) if self.q_lora_rank else self.wq(x)
        # -1 heads: under tensor parallelism (wq / wq_b and wkv_b column-wise, wo row-wise) each rank
        # holds a slice of the heads; the latent projections wq_a / wkv_a stay replicated.
        q = q.view(bsz, seq, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        c_kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(bsz, 1, seq, self.qk_rope_head_dim)  # one rotary key shared by every head
        if self.config.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        cos, sin = rope
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        selection = self._index(x, q_latent, rope, cache) if self.indexer is not None else None
        # batch-invariant mode attends over the absorbed latent also without a cache, so the trainer
        # computes exactly what the engine's cache path computes
        if cache is not None or numerics.is_batch_invariant():
            keep = selection[0] if selection is not None and self.indexer.sparse else None
            return self._forward_absorbed(q_nope, q_pe, c_kv, k_pe, cache, keep)

        kv = self.wkv_b(self.kv_norm(c_kv)).view(bsz, seq, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv.transpose(1, 2), [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if selection is None:
            out = self.full_attention(q, k, v, causal=True, scale=self.scale)  # [B, H, T, v_head_dim]
        else:
            out = self._indexed_attention(q, k, v, *selection)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _index(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's ``(keep [B, 1, T, S], scores [B, T, S])`` over this call's tokens, or over the
        cache's context (its keys stored and gathered beside the latent)."""
        if numerics.is_batch_invariant():
            raise NotImplementedError(
                "batch-invariant mode does not cover DeepSeek-V3.2 sparse attention (op 'sparse_indexer.topk_mask': "
                "the indexer's top-k selection feeding a masked MLA attention, which the batch_invariant kernel "
                "cannot take); see docs/numerics.md")
        if cache is None:
            if self.attention_wrapper is not None:
                raise NotImplementedError("DeepSeek-V3.2 sparse attention under an attention wrapper (context "
                                          "parallelism): the indexer's top-k needs every key; not supported")
            return self.indexer(x, q_latent, rope, causal_allowed(x.shape[1], x.device))
        keys = cache.gather_index_keys(self.indexer.keys(x, rope))
        return self.indexer(x, q_latent, rope, position_mask(cache.q_positions, keys.shape[1]), keys=keys)

    def _indexed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                           scores: torch.Tensor) -> torch.Tensor:
        """Attention over the indexer's keys (``stage="sparse"``) or all causal keys (dense warm-up);
        records the indexer's loss in training."""
        seen = keep if self.indexer.sparse else causal_allowed(q.shape[2], q.device)
        if self.indexer.records_loss:
            self.indexer.record_loss(scores, q, k, self.scale, seen)
        if not self.indexer.sparse:
            return self.full_attention(q, k, v, causal=True, scale=self.scale)
        return get_attention(self.active_backend)(q, k, v, causal=False, mask=keep, scale=self.scale)

    def _forward_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                          cache: Any, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the latent with ``wkv_b`` absorbed (module docstring): over the cache's
        context (``keep``: the indexer's selection over it), or (``cache is None``) causally over
        this call's own tokens."""
        bsz, _, seq, _ = q_nope.shape
        latent = torch.cat([self.kv_norm(c_kv), k_pe.squeeze(1)], dim=-1)  # [B, T, kv_lora_rank + rope]
        w = self.absorbed_kv_weight().view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]
        q = torch.cat([numerics.head_matmul(q_nope, w_uk), q_pe], dim=-1)
        if cache is None:
            kv = latent[:, None]  # one key/value head shared by every query head
            out = self.full_attention(q, kv, kv[..., : self.kv_lora_rank], causal=True, scale=self.scale)
        elif keep is not None:
            out = cache.attend_latent(q, latent, value_dim=self.kv_lora_rank, backend=self.active_backend,
                                      scale=self.scale, mask=keep)
        else:
            out = cache.attend_latent(q, latent, value_dim=self.kv_lora_rank, backend=self.active_backend,
                                      scale=self.scale)  # [B, H, T, kv_lora_rank]
        out = numerics.head_matmul(out, w_uv.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
