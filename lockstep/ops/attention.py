"""Attention kernels behind one signature, chosen by name from config (never by editing a model).

Every backend takes ``q [B, H, T, D]`` and ``k, v [B, Hkv, S, D]`` (grouped-query heads are
expanded here, not in the model) and returns ``[B, H, T, D]``. ``causal`` masks key positions after
each query, aligned so the last query sees the last key (which makes cached decode with T < S work).

Generation (the KV-cache path, ``lockstep.generate``) uses a second signature, registered per backend
name with :func:`register_cached_attention`: ``q [B, H, T, D]`` for the *new* tokens only, ``k, v
[B, Hkv, S, D(v)]`` each sequence's whole gathered context (key ``s`` holds position ``s``; slots past
the sequence's length are padding) and ``q_positions [B, T]``, the absolute position of every query.
Query ``(b, t)`` attends keys ``s <= q_positions[b, t]``; rows are independent, so sequences of
different lengths share one call. A layer picks the cached variant of its own backend by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]
_BACKENDS: dict[str, AttentionFn] = {}
_CACHED_BACKENDS: dict[str, AttentionFn] = {}


def register_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    def decorator(fn: AttentionFn) -> AttentionFn:
        _BACKENDS[name] = fn
        return fn

    return decorator


def attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention(name: str) -> AttentionFn:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from {attention_backends()}") from None


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each key/value head so there is one per query head (GQA -> MHA layout)."""
    groups = n_heads // x.shape[1]
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


@register_attention("sdpa")
def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch scaled_dot_product_attention (the flash kernel on CPU when no mask is given).

    Without a mask, grouped heads go to the kernel as they are (``enable_gqa``), which saves the
    copy of expanded keys/values and its backward; masked calls expand them first.
    """
    if mask is None and causal and q.shape[2] != k.shape[2]:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


@register_attention("reference")
def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain softmax(q k^T / sqrt(d)) v with fp32 scores: slow, obviously correct."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is None and causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def causal_mask(t_q: int, t_k: int, device: torch.device | str) -> torch.Tensor:
    """Boolean [t_q, t_k] mask, True where attention is allowed; queries are the last t_q keys."""
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    return k_pos <= q_pos


def register_cached_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Register the KV-cache (generation) variant of backend ``name`` (see the module docstring)."""
    def decorator(fn: AttentionFn) -> AttentionFn:
        _CACHED_BACKENDS[name] = fn
        return fn

    return decorator


def cached_attention_backends() -> list[str]:
    return sorted(_CACHED_BACKENDS)


def get_cached_attention(name: str) -> AttentionFn:
    try:
        return _CACHED_BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention backend {name!r} has no KV-cache (generation) variant; backends with one: "
                         f"{cached_attention_backends()}") from None


def position_mask(q_positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask, True where key s (at position s) is at or before the query's position."""
    keys = torch.arange(context_len, device=q_positions.device)
    return keys <= q_positions[:, None, :, None]


@register_cached_attention("sdpa")
def sdpa_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA over a gathered context. Grouped query heads are folded into the query rows
    ([B, Hkv, groups * T, D]) instead of expanding keys/values to every head: no K/V copy."""
    b, h, t, _ = q.shape
    hkv = k.shape[1]
    groups = h // hkv
    mask = position_mask(q_positions, k.shape[2])
    if groups > 1:
        q = q.reshape(b, hkv, groups * t, q.shape[-1])
        mask = mask.repeat(1, 1, groups, 1)  # row g * T + t is query head (kv_head * groups + g), token t
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, t, v.shape[-1])


@register_cached_attention("reference")
def reference_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain masked softmax(q k^T * scale) v with fp32 scores over a gathered context."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~position_mask(q_positions, k.shape[2]), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
