"""Batch-invariant kernels: a row's result does not depend on the other rows in the call.

Measured on this CPU (torch 2.13, oneDNN/MKL): a plain ``x @ W`` picks its kernel by the row
count (GEMV for one row, other micro-kernels below ~16 rows, other thread splits above), so the
same row gives different bits in a batch of 1, 7 or 64; row reductions (sum, mean, amax, softmax,
log_softmax, RMSNorm) and elementwise ops do not. Two ways to make a row's bits fixed:

* **C kernels** for the attention forward and the fp32 linear (:mod:`lockstep.ops.bi_kernel`, used
  wherever a C compiler builds them): compiled without fast-math or FMA contraction, so the source
  order is the arithmetic order; each query row reduces its visible keys in position order, each
  linear output is a dot product in a fixed lane order set by K alone, depending on nothing but its
  own inputs. No padding, tiles or copies, and the thread count does not matter. The bf16 linear
  is :mod:`lockstep.ops.decode_linear` at the process's :mod:`~lockstep.ops.isa` level (AMX tiles,
  ``vdpbf16ps``, or plain C with ``vdpbf16ps``'s bits; sums in an order set by K alone:
  row-invariant by construction), its weight packed on every call (no cached copy to go stale)
  except in the engine's :class:`~lockstep.generate.packed.PackedLinear`, whose cached pack holds
  the very same bytes.
* **Fixed-shape tiles** (without the C kernels: no compiler, other devices): a library call of
  one fixed shape (an ``mm``, or a ``bmm`` of at least 2 entries of one shape) gives each row the
  same bits whatever the number of calls or entries and the row's neighbours - on this CPU's MKL
  path; on MKL's AVX2 path a row's bits also depend on its place in the tile, so the fallbacks are
  not invariant there (docs/numerics.md). :func:`tiled_matmul`: rows padded to a multiple of
  ``row_tile(dtype)`` (16 in fp32, 128 in bf16, where oneDNN is slow below that), one ``mm`` per
  tile. :func:`tiled_attention_forward` (the attention fallback): keys in fixed chunks of
  ``KV_CHUNK`` positions, query rows in tiles of ``ATTN_ROW_TILE``, one bmm entry per (tile,
  chunk), the max over every visible key, chunk partials summed in chunk order.

MLA's per-head projections (:func:`head_matmul`) are per head this module's :func:`linear`, and
elementwise transcendentals go through :func:`elementwise` (whole vectors, one-thread pieces).

Under tensor parallelism (weights that are DTensors of the TP styles) :func:`linear` runs on the
local shards, row-parallel partials summed in a fixed order (:mod:`lockstep.ops.tp_invariant`): a trainer and a
generator of one TP degree agree bitwise, and ``k_split`` lets one degree reproduce another's
sums (:mod:`lockstep.parallel.tp_sums`).

Both make a query at position t get the same bits from a full-sequence forward (trainer, prefill)
and from a KV-cache decode step. The two are not bitwise equal to each other; a process uses one
(:func:`bi_kernel.available` is decided once). Backward passes are the ordinary ones (only forward
values must be invariant). Attention computes in fp32 (inputs upcast); linear computes in its input
dtype (under autocast: the autocast dtype, as ``F.linear`` would).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lockstep.ops import bi_kernel, decode_linear
from lockstep.ops.attention import BATCH_INVARIANT, register_attention_backend, with_sink_key
from lockstep.ops.tp_invariant import sharded_linear, tree_sum

#: fp32 rows per tile: one tile holds a 16-sequence decode step (32 would double its work, and
#: pad a single sequence's row 32-fold); at trainer sizes 16 and 32 cost about the same
ROW_TILE = 16
#: bf16/fp16 bmm on CPU is fast only from about 128 rows per entry (oneDNN); fp32 is fine at 16
HALF_ROW_TILE = 128
ATTN_ROW_TILE = 16
KV_CHUNK = 32
#: PyTorch's CPU elementwise kernels split a call across threads from this many elements on
#: (``at::internal::GRAIN_SIZE``); a call of at most this many runs on one thread
ELEMENTWISE_GRAIN = 32768


def row_tile(dtype: torch.dtype) -> int:
    """Rows per tile for ``dtype``: fixed per dtype, so trainer and generator agree."""
    return HALF_ROW_TILE if dtype in (torch.bfloat16, torch.float16) else ROW_TILE


def tiled_matmul(a: torch.Tensor, b: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` computed as fixed ``[tile, K] @ [K, N]`` products, one ``mm`` per
    tile: every library call has one shape, so one kernel and thread split. (Not one ``bmm`` over
    the tiles: MKL's batched SGEMM runs a call of one entry otherwise than calls of several, other
    bits from K = 1024 on this CPU and K = 192 on MKL's AVX2 path, so a decode step's lone tile
    differed from the trainer's; and oneDNN's bf16 bmm is several times slower than its mm.)"""
    tile = tile or row_tile(a.dtype)
    m = a.shape[0]
    n_tiles = max(1, -(-m // tile))
    padded = F.pad(a, (0, 0, 0, n_tiles * tile - m)) if n_tiles * tile != m else a
    out = a.new_empty(n_tiles * tile, b.shape[1])
    for i in range(0, n_tiles * tile, tile):
        torch.mm(padded[i:i + tile], b, out=out[i:i + tile])
    return out[:m]


def c_bf16_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the batch-invariant bf16 linear of ``x @ weight.T`` is a :mod:`decode_linear` C kernel
    here (on CPU wherever it builds: AMX, ``vdpbf16ps`` or plain C by the :mod:`~lockstep.ops.isa`
    level; ``decode_linear.kernel`` names the one)."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.device.type == "cpu"
            and decode_linear.supports(*weight.shape) and decode_linear.available())


def _weight_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T``: in fp32 on CPU the C kernel (fixed-order dot products of
    rows read in place: no padding, and no cached weight copy to go stale when collectives or
    FSDP's all-gather write the weight), in bf16 on CPU the bf16 C kernel of this ISA level on a
    pack made now (the engine's packed layers run the same kernel on a cached pack of the same
    bytes), otherwise (no compiler, other devices) fixed row tiles."""
    if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.device.type == "cpu"
            and bi_kernel.available()):
        return bi_kernel.linear(x, weight)
    if c_bf16_applies(x, weight):
        return decode_linear.linear(x, decode_linear.pack(weight), weight.shape[0])
    return tiled_matmul(x, weight.t())


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _weight_matmul(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = (flat @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_split: int = 1
           ) -> torch.Tensor:
    """Batch-invariant ``F.linear`` (autocast honoured: inputs cast as F.linear's would be).

    ``k_split`` > 1: the dot products over K computed as ``k_split`` partials over equal slices of
    K (the bias joins the first), added by :func:`~lockstep.ops.tp_invariant.tree_sum`: the
    arithmetic of a row-parallel layer sharded ``k_split`` ways, so one layout reproduces another's
    bits (:func:`lockstep.parallel.tp_sums.split_row_parallel_sums`). A tensor-parallel weight (a
    DTensor) is computed on its local shards (:func:`~lockstep.ops.tp_invariant.sharded_linear`),
    a row-parallel one split ``k_split`` ways locally."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            return _linear(x, weight, bias, k_split)
    return _linear(x, weight, bias, k_split)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_split: int = 1) -> torch.Tensor:
    if isinstance(weight, DTensor):
        return sharded_linear(x, weight, bias, k_split, _linear)
    if k_split > 1:
        if weight.shape[1] % k_split:
            raise ValueError(f"batch-invariant linear: k_split={k_split} does not divide K={weight.shape[1]}")
        first = [1.0] + [0.0] * (k_split - 1)  # the bias on every part's gradient path, zero but in the first
        return tree_sum([_linear(xi, wi, None if bias is None else bias * f)
                         for xi, wi, f in zip(x.chunk(k_split, -1), weight.chunk(k_split, 1), first)])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _TiledLinear.apply(x, weight, bias)
    out = _weight_matmul(x.reshape(-1, x.shape[-1]), weight)  # no autograd node: same forward
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, K] @ weight [H, K, N] -> [B, H, T, N]`` (a per-head projection, e.g. MLA's
    absorbed ``wkv_b``): each head is this module's :func:`linear` of its rows, so a per-head
    product takes the very kernel a linear layer of that shape and dtype takes (the fp32 C kernel,
    the bf16 C kernel, or fixed row tiles), autocast and gradients included.

    Not one batched library GEMM over (head, row tile) entries, as it was: MKL's batched SGEMM
    picks its kernel and thread split by the entry count on some code paths (measured here on its
    AVX2 path, which non-Intel CPUs get: ``[16, 512] @ [512, 32]`` entries change bits between a
    call of 1 entry and of 2), so a row's bits moved with the number of tokens in the call, and MLA
    models were the one family whose fp32 batch-invariant path still ran a library GEMM."""
    b, h, t, k = x.shape
    rows = x.transpose(0, 1).reshape(h, b * t, k)
    out = torch.stack([linear(rows[i], weight[i].t()) for i in range(h)])
    return out.reshape(h, b, t, -1).transpose(0, 1)


class _ChunkedAttention(torch.autograd.Function):
    """Invariant forward; the backward is ordinary SDPA math (only forward values must be
    batch-invariant, and differentiating through the tile copies costs ~5x). For the trainer's
    full sequence with the C kernel, SDPA's flash backward runs on the kernel's output and
    log-sum-exp (nothing recomputed); otherwise SDPA is recomputed from q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, scale, square_causal, window=0, keep0=False):
        ctx.scale, ctx.square_causal, ctx.window, ctx.keep0 = scale, square_causal, window, keep0
        if (square_causal and q.device.type == "cpu" and bi_kernel.available()
                and q.dtype == k.dtype == v.dtype and v.shape[-1] == q.shape[-1]):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            out, lse = bi_kernel.attention_forward(q, k, v, q_positions, scale, with_lse=True)
            ctx.save_for_backward(q, k, v, q_positions, out, lse)
            return out
        ctx.save_for_backward(q, k, v, q_positions)
        return attention_forward(q, k, v, q_positions, scale, window, keep0)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_positions, *saved = ctx.saved_tensors
        if saved:
            out, lse = saved
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.to(out.dtype), q, k, v, out, lse, 0.0, True, scale=ctx.scale)
            return (*(g if t.requires_grad else None for g, t in zip(grads, (q, k, v))), None, None, None, None, None)
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            if ctx.square_causal:  # the trainer's full sequence: the flash kernel's backward
                out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=ctx.scale,
                                                     enable_gqa=k.shape[1] != q.shape[1])
            else:
                groups = q.shape[1] // k.shape[1]
                kx, vx = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k_, v_))
                mask = visible_keys(q_positions, k.shape[2], ctx.window, ctx.keep0)
                out = F.scaled_dot_product_attention(q_, kx, vx, attn_mask=mask, scale=ctx.scale)
            inputs = [t for t in (q_, k_, v_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad))
        return (next(grads) if q.requires_grad else None, next(grads) if k.requires_grad else None,
                next(grads) if v.requires_grad else None, None, None, None, None, None)


def visible_keys(q_positions: torch.Tensor, n_keys: int, window: int = 0, keep0: bool = False) -> torch.Tensor:
    """``[B, 1, T, S]``: key ``s`` is visible to query ``(b, t)`` (``s <= q_positions[b, t]``; with a window
    also ``s > q_positions[b, t] - window``, key 0 excepted with ``keep0``: a sink key)."""
    keys = torch.arange(n_keys, device=q_positions.device)
    pos = q_positions[:, None, :, None]
    mask = keys <= pos
    if window:
        mask = mask & ((keys > pos - window) | ((keys == 0) if keep0 else False))
    return mask


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                      scale: float | None = None, square_causal: bool = False, window: int = 0,
                      keep0: bool = False) -> torch.Tensor:
    """Causal attention by absolute position, batch-invariant (module docstring).

    ``q [B, H, T, D]``, ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]`` with key ``s`` at position
    ``s``; ``q_positions [B, T]``: query ``(b, t)`` sees keys ``s <= q_positions[b, t]``. Returns
    ``[B, H, T, Dv]`` in q's dtype. Keys past a sequence's length must be finite (they get weight 0).
    ``square_causal``: the caller promises S == T and ``q_positions`` is ``arange(T)`` in every row
    (the trainer's full sequence), which lets the backward use the flash kernel. ``window`` /
    ``keep0``: :func:`visible_keys` (a window is never ``square_causal``).
    """
    square_causal = square_causal and not window
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _ChunkedAttention.apply(q, k, v, q_positions, scale, square_causal, window, keep0)
    return attention_forward(q, k, v, q_positions, scale, window, keep0)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                      scale: float | None, window: int = 0, keep0: bool = False) -> torch.Tensor:
    """The invariant forward: the C kernel (:mod:`lockstep.ops.bi_kernel`) on CPU where it builds,
    else :func:`tiled_attention_forward` (one choice per process and device, so both sides of a
    comparison agree)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.device.type == "cpu" and bi_kernel.available():
        return bi_kernel.attention_forward(q, k, v, q_positions, scale, window=window, keep0=keep0)
    return tiled_attention_forward(q, k, v, q_positions, scale, window, keep0)


def _bmm_entries(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm`` of fixed-shape entries, never fewer than 2 in a call: MKL's batched SGEMM runs
    a lone entry like a plain GEMM (its own thread split: other bits from K = 1024 on this CPU,
    K = 192 on MKL's AVX2 path) and calls of 2 or more in parallel over entries, which give each
    entry the same bits whatever their number and place (measured up to 21 entries, K <= 4096, on
    both paths)."""
    if a.shape[0] >= 2:
        return torch.bmm(a, b)
    return torch.bmm(torch.cat([a, a]), torch.cat([b, b]))[:1]


def elementwise(fn, x: torch.Tensor, multiple: int = 64) -> torch.Tensor:
    """``fn(x)`` for an elementwise transcendental (silu, sigmoid, exp, ...) over ``x [..., D]``,
    every element computed by the same vector code whatever its place.

    PyTorch's CPU elementwise kernels run the last ``n % (2 * vector width)`` elements of each
    thread's range through a scalar loop whose exp/sigmoid can differ from the vector code in the
    last bit, so a row's bits depend on where it sits in the tensor: with a last dim that is not a
    multiple of 32 (8 router scores, an FFN width of 40) and, in calls over ``ELEMENTWISE_GRAIN``
    elements, at the boundary between two threads' ranges (measured: silu of ``[1001, 96]``). Here
    the last dim is padded to a multiple of ``multiple`` and ``fn`` runs on pieces of
    ``ELEMENTWISE_GRAIN`` elements (each on one thread, all whole vectors)."""
    width = x.shape[-1]
    pad = -width % multiple
    flat = (F.pad(x, (0, pad)) if pad else x).reshape(-1)
    if flat.numel() <= ELEMENTWISE_GRAIN:
        out = fn(flat)
    else:
        out = torch.cat([fn(piece) for piece in flat.split(ELEMENTWISE_GRAIN)])
    return out.view(*x.shape[:-1], width + pad)[..., :width]


def tiled_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                            scale: float | None, window: int = 0, keep0: bool = False) -> torch.Tensor:
    bsz, heads, t, d = q.shape
    kv_heads, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups, g_rows = heads // kv_heads, heads // kv_heads * t
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_q = max(1, -(-g_rows // ATTN_ROW_TILE))
    n_c = max(1, -(-s // KV_CHUNK))
    pad_rows, pad_keys = n_q * ATTN_ROW_TILE - g_rows, n_c * KV_CHUNK - s
    # rows of one kv head: (group, t); tiles of ATTN_ROW_TILE rows
    rows = q.float().reshape(bsz, kv_heads, g_rows, d)
    rows = F.pad(rows, (0, 0, 0, pad_rows)).reshape(bsz, kv_heads, n_q, 1, ATTN_ROW_TILE, d)
    pos = q_positions[:, None, None, :].expand(bsz, kv_heads, groups, t).reshape(bsz, kv_heads, g_rows)
    pos = F.pad(pos, (0, pad_rows)).reshape(bsz, kv_heads, n_q, 1, ATTN_ROW_TILE, 1)
    keys = F.pad(k.float(), (0, 0, 0, pad_keys)).reshape(bsz, kv_heads, 1, n_c, KV_CHUNK, d)
    values = F.pad(v.float(), (0, 0, 0, pad_keys)).reshape(bsz, kv_heads, 1, n_c, KV_CHUNK, dv)
    entries = bsz * kv_heads * n_q * n_c
    shape = (bsz, kv_heads, n_q, n_c)
    scores = _bmm_entries(rows.expand(*shape, ATTN_ROW_TILE, d).reshape(entries, ATTN_ROW_TILE, d),
                          keys.expand(*shape, KV_CHUNK, d).reshape(entries, KV_CHUNK, d).transpose(1, 2))
    scores = scores.reshape(*shape, ATTN_ROW_TILE, KV_CHUNK) * scale
    key_pos = torch.arange(n_c * KV_CHUNK, device=q.device).reshape(n_c, 1, KV_CHUNK)
    hidden = key_pos > pos
    if window:  # keys before the window (a sink key 0 excepted) add exact zeros, as masked ones do
        hidden = hidden | ((key_pos <= pos - window) & ~((key_pos == 0) & keep0))
    scores = scores.masked_fill(hidden, float("-inf"))
    peak = scores.amax(dim=(3, 5), keepdim=True)  # exact: max does not depend on order
    probs = elementwise(torch.exp, scores - peak, multiple=KV_CHUNK)  # fp32: 2 vectors of 16
    partial = _bmm_entries(probs.reshape(entries, ATTN_ROW_TILE, KV_CHUNK),
                           values.expand(*shape, KV_CHUNK, dv).reshape(entries, KV_CHUNK, dv))
    partial = partial.reshape(*shape, ATTN_ROW_TILE, dv)
    sums = probs.sum(-1)  # [B, Hkv, nq, nc, tile]
    out, total = partial[:, :, :, 0], sums[:, :, :, 0]
    for j in range(1, n_c):  # chunk order fixed: chunks a query cannot see add exact zeros
        out, total = out + partial[:, :, :, j], total + sums[:, :, :, j]
    out = (out / total[..., None]).reshape(bsz, kv_heads, n_q * ATTN_ROW_TILE, dv)[:, :, :g_rows]
    return out.reshape(bsz, heads, t, dv).to(q.dtype)


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    mask: torch.Tensor | None = None, scale: float | None = None,
                    sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """The backend signature of :mod:`lockstep.ops.attention` (the last query sees the last key)."""
    if mask is not None or not causal:
        raise ValueError("attention backend 'batch_invariant' supports causal attention without an explicit mask")
    t, s = q.shape[2], k.shape[2]
    positions = torch.arange(s - t, s, device=q.device).expand(q.shape[0], t)
    if sinks is not None or window:
        return _cached_attention(q, k, v, q_positions=positions, scale=scale, sinks=sinks, window=window)
    return chunked_attention(q, k, v, positions, scale, square_causal=t == s)


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
                      scale: float | None = None, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Sinks join as key 0 (:func:`~lockstep.ops.attention.with_sink_key`, positions shifted by one,
    key 0 kept visible under a window): the trainer's and the generator's calls build it alike, so
    they still agree bitwise; a window hides earlier keys as +0 terms (:func:`visible_keys`)."""
    if sinks is not None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        q, k, v = with_sink_key(q, k, v, sinks, scale)
        q_positions = q_positions + 1
    return chunked_attention(q, k, v, q_positions, scale, window=window, keep0=sinks is not None)


register_attention_backend(BATCH_INVARIANT, forward=_full_attention, cached=_cached_attention)
