"""Decode attention read in place from the paged KV cache (``csrc/paged_attention.c``), as a torch op.

The generation engine's decode step (one new token per sequence) otherwise gathers each layer's
contexts into contiguous ``[B, Hkv, S, D]`` copies and runs SDPA on them; this kernel reads the keys
and values where they sit in the block pools, through the block tables, once per (sequence, kv head)
for all the query heads that share them. fp32 arithmetic, softmax with the row maximum subtracted
(the C file states the order); close to SDPA (tested), not its bits. Built per
:mod:`~lockstep.ops.isa` level: an AVX-512 path (levels avx512 and amx) and a portable one, both
tested wherever they run. Optional attention sinks (per-head logits in every softmax denominator)
and a sliding window (only the last ``window`` positions are read) for GPT-OSS. Used by
:meth:`lockstep.generate.cache.LayerCache.attend` for the ``sdpa`` backend on CPU when
:func:`usable` says so; the batch-invariant and reference backends never take it.

``lockstep::paged_decode_attention`` is a plain ``torch.library`` schema with a CPU kernel and a fake
(shape) function, so a compiled decode step traces it as one call.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from lockstep.ops import isa
from lockstep.ops.cbuild import build_library

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared"]
#: the kernel's dot-product lanes: head dims must be a multiple
LANES = 16


def _library() -> ctypes.CDLL | None:
    return _built("avx512" if isa.at_least("avx512") else "portable")


@functools.cache
def _built(level: str) -> ctypes.CDLL | None:
    lib = build_library(f"paged_attention_{level}", [_SOURCE], _FLAGS + isa.march_flags(level),
                        "the paged decode attention kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_attention.argtypes = [ptr] * 6 + [i64] * 9 + [ctypes.c_float, ctypes.c_int, ptr, i64]
    lib.paged_decode_attention.restype = None
    return lib


def available() -> bool:
    """Whether the kernel could be built and loaded here (decided once per process and level)."""
    return _library() is not None


def usable(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether a decode call with query ``q [B, H, 1, D]`` and these pools fits the kernel (shapes,
    dtypes, device: traceable checks only; :func:`available` is the caller's, outside compiled code). The
    pools may have any strides with a contiguous head dim, the same for both."""
    return (q.dim() == 4 and q.shape[2] == 1 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)
            and k_pool.dtype == q.dtype and v_pool.dtype == q.dtype and k_pool.shape == v_pool.shape
            and k_pool.stride() == v_pool.stride() and k_pool.stride(3) == 1
            and q.shape[-1] == k_pool.shape[-1] and q.shape[-1] % LANES == 0
            and q.shape[1] % k_pool.shape[2] == 0 and not q.requires_grad)


_LIB = torch.library.Library("lockstep", "FRAGMENT")
_LIB.define("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
            "Tensor positions, float scale, Tensor? sinks=None, int window=0) -> Tensor")


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           positions: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """``q [B, H, 1, D]``, pools ``[blocks, block_size, Hkv, D]`` (any strides, a contiguous ``D``, the
    same for both: the cache's are head-major views), ``block_tables [B, W]`` (int64),
    ``positions [B, 1]`` (query b attends context positions 0..positions[b]) -> ``[B, H, 1, D]``.
    ``sinks [H]``: per-head logits in the softmax denominator; ``window`` > 0: only positions
    ``positions[b] - window < s`` are read."""
    b, heads, _, d = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    q = q.contiguous()
    tables, pos = _int64(block_tables), _int64(positions)  # [B, 1] and [B] are one layout when contiguous
    out = torch.empty_like(q)
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    _library().paged_decode_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(),
                                      pos.data_ptr(), out.data_ptr(), b, heads, kv_heads, d, block_size,
                                      tables.shape[1], *k_pool.stride()[:3], scale, int(q.dtype == torch.bfloat16),
                                      None if sink_logits is None else sink_logits.data_ptr(), int(window))
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    # the engine's tables and positions already are: skip the conversions' dispatches (30 layers a step)
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


_LIB.impl("paged_decode_attention", paged_decode_attention, "CPU")


@torch.library.register_fake("lockstep::paged_decode_attention")
def _(q, k_pool, v_pool, block_tables, positions, scale, sinks=None, window=0):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
