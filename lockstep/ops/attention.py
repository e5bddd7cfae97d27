"""Attention backends: one registry of kernels by name, and how an attention layer finds its kernel.

A backend is registered once (:func:`register_attention_backend`) as an :class:`AttentionBackend` with
every variant it has:

* ``forward`` (training, scoring): ``q [B, H, T, D]`` and ``k, v [B, Hkv, S, D]`` (grouped-query heads
  are expanded here, not in the model) -> ``[B, H, T, D]``. ``causal`` masks key positions after each
  query, aligned so the last query sees the last key (which makes cached decode with T < S work).
* ``cached`` (generation, :mod:`lockstep.generate`): ``q [B, H, T, D]`` for the *new* tokens only,
  ``k, v [B, Hkv, S, D(v)]`` each sequence's whole gathered context (key ``s`` holds position ``s``;
  slots past the sequence's length are padding) and ``q_positions [B, T]``, the absolute position of
  every query. Query ``(b, t)`` attends keys ``s <= q_positions[b, t]``; rows are independent, so
  sequences of different lengths share one call.
* ``paged`` (optional, :class:`PagedAttention`): a decode step (T = 1) that reads keys and values in
  place from the paged cache's block pools instead of a gathered copy.

``forward`` and ``cached`` also take ``sinks`` (None, or ``[H]`` learned per-head logits that join every
softmax denominator and attend to nothing: GPT-OSS's attention sinks) and ``window`` (0, or a sliding
window: a query at position p sees keys p - window < s <= p, as transformers' ``sliding_window``).
Layers pass them only when set, so a backend without them is still called as before; one that
cannot honour them raises. :func:`with_sink_key` turns a sink into an ordinary key (one extra key
coordinate, one extra key in front), which lets a kernel without sink support (SDPA's flash kernel,
the batch-invariant kernel) compute it exactly.

How a layer finds its kernel (the one mechanism; nothing swaps a module's attributes): attention
modules subclass :class:`AttentionLayer`, which holds ``backend_name`` (the configured name, from the
model config; fixed) and ``attention_wrapper`` (None, or what :func:`set_attention_wrapper` installed,
e.g. context parallelism). On every call the layer runs :func:`resolve_backend` of its configured
name: the ``batch_invariant`` backend while :func:`lockstep.numerics.set_batch_invariant` is on, its
configured one otherwise. The full-sequence kernel is then called through the wrapper, if one is set;
the cached and paged variants (generation) never are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lockstep import numerics
from lockstep.ops import paged_attention

AttentionFn = Callable[..., torch.Tensor]
#: ``wrapper(inner, q, k, v, *, causal, mask, scale)``: runs the full-sequence kernel ``inner`` its own way
AttentionWrapper = Callable[..., torch.Tensor]
#: the backend every layer resolves to while the batch-invariant switch is on (lockstep.ops.batch_invariant)
BATCH_INVARIANT = "batch_invariant"


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """A decode kernel reading keys/values in place from the block pools of :mod:`lockstep.generate.cache`."""

    #: ``available(device)``: whether the kernel runs on ``device`` in this process (may build it: the
    #: cache asks once, outside any compiled region)
    available: Callable[[torch.device], bool]
    #: ``usable(q, k_pool, v_pool)``: whether one call's shapes and dtypes fit (traceable checks only)
    usable: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool]
    #: ``attend(q [B, H, 1, D], k_pool, v_pool [blocks, block_size, Hkv, D], block_tables [B, W],
    #: q_positions [B, 1], scale: float | None, **sink_window) -> [B, H, 1, D]``
    attend: Callable[..., torch.Tensor]
    #: whether ``attend`` takes the ``sinks`` / ``window`` keywords (layers with them skip a kernel without)
    sinks_and_windows: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One attention backend with its variants (see the module docstring for the signatures)."""

    name: str
    forward: AttentionFn
    cached: AttentionFn | None = None
    paged: PagedAttention | None = None


_REGISTRY: dict[str, AttentionBackend] = {}


def register_attention_backend(name: str, *, forward: AttentionFn, cached: AttentionFn | None = None,
                               paged: PagedAttention | None = None) -> AttentionBackend:
    """Register backend ``name`` with its variants (registering a name again replaces it)."""
    backend = AttentionBackend(name, forward, cached, paged)
    _REGISTRY[name] = backend
    return backend


def attention_backends() -> list[str]:
    return sorted(_REGISTRY)


def cached_attention_backends() -> list[str]:
    return sorted(name for name, b in _REGISTRY.items() if b.cached is not None)


def attention_backend(name: str) -> AttentionBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from {attention_backends()}") from None


def get_attention(name: str) -> AttentionFn:
    """The full-sequence kernel of backend ``name``."""
    return attention_backend(name).forward


def get_cached_attention(name: str) -> AttentionFn:
    """The KV-cache (generation) kernel of backend ``name``."""
    fn = attention_backend(name).cached
    if fn is None:
        raise ValueError(f"attention backend {name!r} has no KV-cache (generation) variant; backends with one: "
                         f"{cached_attention_backends()}")
    return fn


def paged_attention_kernels(device: torch.device) -> dict[str, PagedAttention]:
    """Backend name -> its paged decode variant, for the backends whose paged kernel runs on ``device`` here."""
    return {name: b.paged for name, b in _REGISTRY.items() if b.paged is not None and b.paged.available(device)}


def resolve_backend(configured: str) -> str:
    """The backend a layer configured with ``configured`` runs now: ``batch_invariant`` while the
    batch-invariant switch is on, ``configured`` otherwise (read per call: traceable)."""
    return BATCH_INVARIANT if numerics.is_batch_invariant() else configured


class AttentionLayer(nn.Module):
    """Base of attention modules whose kernel comes from this registry (module docstring)."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        attention_backend(backend)  # unknown names fail at build time, naming the choices
        #: the configured backend (the model config's ``attention.backend``); never rewritten
        self.backend_name = backend
        #: installed by :func:`set_attention_wrapper` around the full-sequence kernel (None: call it directly)
        self.attention_wrapper: AttentionWrapper | None = None

    @property
    def active_backend(self) -> str:
        """The backend this layer runs now (:func:`resolve_backend`)."""
        return resolve_backend(self.backend_name)

    def full_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                       scale: float | None = None, sinks: torch.Tensor | None = None,
                       window: int = 0) -> torch.Tensor:
        """Attention of ``q`` over ``k, v`` with the active backend's full-sequence kernel, through the
        installed wrapper if there is one. ``sinks`` / ``window``: the module docstring."""
        fn = _REGISTRY[self.active_backend].forward
        extra = sink_window_kwargs(sinks, window)
        if self.attention_wrapper is not None:
            if extra:
                raise ValueError(f"attention wrapper {self.attention_wrapper!r} (e.g. context parallelism) does not "
                                 f"support attention sinks or sliding windows ({sorted(extra)})")
            return self.attention_wrapper(fn, q, k, v, causal=causal, mask=None, scale=scale)
        return fn(q, k, v, causal=causal, scale=scale, **extra)


def sink_window_kwargs(sinks: torch.Tensor | None, window: int) -> dict:
    """The ``sinks`` / ``window`` keywords of a backend call: only those that are set."""
    extra: dict = {}
    if sinks is not None:
        extra["sinks"] = sinks
    if window:
        extra["window"] = window
    return extra


def with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sink as an ordinary key: ``q`` gains a coordinate ``sinks[h] / scale``, ``k`` a zero one, and
    key 0 (new, in front) is ``[0, ..., 0, 1]`` with value 0, so ``scale * q.k0`` is the head's sink
    logit. Callers shift key positions by one and must pass ``scale`` explicitly (the head dim grew)."""
    b, h, t, d = q.shape
    col = (sinks.float() / scale).to(q.dtype).view(1, h, 1, 1).expand(b, h, t, 1)
    sink_key = torch.zeros(b, k.shape[1], 1, d + 1, dtype=k.dtype, device=k.device)
    sink_key[..., d] = 1.0
    return (torch.cat([q, col], dim=-1), torch.cat([sink_key, F.pad(k, (0, 1))], dim=2),
            F.pad(v, (0, 0, 1, 0)))


def attention_layers(model: nn.Module) -> Iterator[AttentionLayer]:
    """Every :class:`AttentionLayer` in ``model``."""
    return (m for m in model.modules() if isinstance(m, AttentionLayer))


def set_attention_wrapper(model: nn.Module, wrapper: AttentionWrapper | None) -> int:
    """Install ``wrapper`` around the full-sequence kernel of every attention layer of ``model``
    (``None`` removes it); returns how many layers there are."""
    count = 0
    for layer in attention_layers(model):
        layer.attention_wrapper = wrapper
        count += 1
    return count


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each key/value head so there is one per query head (GQA -> MHA layout)."""
    groups = n_heads // x.shape[1]
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """PyTorch scaled_dot_product_attention (the flash kernel on CPU when no mask is given).

    Without a mask, grouped heads go to the kernel as they are (``enable_gqa``), which saves the
    copy of expanded keys/values and its backward; masked calls expand them first. Sinks go in as
    a key (:func:`with_sink_key`); the square causal case then stays on the flash kernel behind a
    zero query row (row r sees keys <= r: query t sees the sink and keys 0..t).
    """
    if window:
        mask = _window_mask(q, k, causal, mask, window)
    if sinks is not None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        q, k, v = with_sink_key(q, k, v, sinks, scale)
        if mask is None and causal and q.shape[2] + 1 == k.shape[2]:
            out = F.scaled_dot_product_attention(F.pad(q, (0, 0, 1, 0)), k, v, is_causal=True, scale=scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            return out[:, :, 1:]
        if mask is None and causal:
            mask = causal_mask(q.shape[2], k.shape[2] - 1, q.device)
        if mask is not None:
            mask = F.pad(mask, (1, 0), value=True)
        causal = False
    if mask is None and causal and q.shape[2] != k.shape[2]:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _window_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None, window: int
                 ) -> torch.Tensor:
    if not causal or mask is not None:
        raise ValueError("a sliding window applies to causal attention without an explicit mask")
    return causal_mask(q.shape[2], k.shape[2], q.device, window)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of fp32 ``scores [B, H, T, S]``, with each head's sink logit in the
    denominator when given (its own probability dropped, as transformers' eager GPT-OSS does)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    b, h, t, _ = scores.shape
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, t, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Plain softmax(q k^T / sqrt(d)) v with fp32 scores: slow, obviously correct."""
    if window:
        mask = _window_mask(q, k, causal, mask, window)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is None and causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax_with_sinks(scores, sinks)
    return torch.matmul(probs, v.float()).to(q.dtype)


def causal_mask(t_q: int, t_k: int, device: torch.device | str, window: int = 0) -> torch.Tensor:
    """Boolean [t_q, t_k] mask, True where attention is allowed; queries are the last t_q keys.
    ``window`` > 0: only the last ``window`` keys up to the query's own."""
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    allowed = k_pos <= q_pos
    return allowed & (k_pos > q_pos - window) if window else allowed


def position_mask(q_positions: torch.Tensor, context_len: int, window: int = 0) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask, True where key s (at position s) is at or before the query's position
    (and, with ``window`` > 0, after position - window)."""
    keys = torch.arange(context_len, device=q_positions.device)
    q_pos = q_positions[:, None, :, None]
    allowed = keys <= q_pos
    return allowed & (keys > q_pos - window) if window else allowed


def sdpa_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """SDPA over a gathered context. Grouped query heads are folded into the query rows
    ([B, Hkv, groups * T, D]) instead of expanding keys/values to every head: no K/V copy."""
    b, h, t, _ = q.shape
    hkv = k.shape[1]
    groups = h // hkv
    mask = position_mask(q_positions, k.shape[2], window)
    if sinks is not None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        q, k, v = with_sink_key(q, k, v, sinks, scale)
        mask = F.pad(mask, (1, 0), value=True)
    if groups > 1:
        q = q.reshape(b, hkv, groups * t, q.shape[-1])
        mask = mask.repeat(1, 1, groups, 1)  # row g * T + t is query head (kv_head * groups + g), token t
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, t, v.shape[-1])


def reference_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Plain masked softmax(q k^T * scale) v with fp32 scores over a gathered context."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~position_mask(q_positions, k.shape[2], window), float("-inf"))
    return torch.matmul(_softmax_with_sinks(scores, sinks), v.float()).to(q.dtype)


def _sdpa_paged_available(device: torch.device) -> bool:
    return device.type == "cpu" and paged_attention.available()


def _sdpa_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                q_positions: torch.Tensor, scale: float | None, sinks: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor:
    scale = paged_attention.default_scale(q.shape[-1]) if scale is None else scale
    return torch.ops.lockstep.paged_decode_attention(q, k_pool, v_pool, block_tables, q_positions, scale,
                                                     sinks, window)


register_attention_backend("sdpa", forward=sdpa_attention, cached=sdpa_cached_attention,
                           paged=PagedAttention(_sdpa_paged_available, paged_attention.usable, _sdpa_paged,
                                                sinks_and_windows=True))
register_attention_backend("reference", forward=reference_attention, cached=reference_cached_attention)
