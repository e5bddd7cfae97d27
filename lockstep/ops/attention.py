"""Attention kernels behind one signature, chosen by name from config (never by editing a model).

Every backend takes ``q [B, H, T, D]`` and ``k, v [B, Hkv, S, D]`` (grouped-query heads are
expanded here, not in the model) and returns ``[B, H, T, D]``. ``causal`` masks key positions after
each query, aligned so the last query sees the last key (which makes cached decode with T < S work).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]
_BACKENDS: dict[str, AttentionFn] = {}


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
