"""The batch-invariant attention forward as a small C kernel (``csrc/bi_attention.c``), via ctypes.

Why C: the tiled-``bmm`` formulation (:func:`lockstep.ops.batch_invariant.tiled_attention_forward`)
makes every row invariant by giving oneDNN fixed-shape entries, which costs a copy of each key chunk
per query tile, padded decode rows and many small ops. In C the arithmetic order is the source
order (no ``-ffast-math``, ``-ffp-contract=off``, explicit ``fmaf``): each query row reduces its
visible keys in position order, whatever else is in the call, so no tiles, padding or copies are
needed. The file's header states the exact order.

The library is compiled once per source/compiler/CPU and :mod:`~lockstep.ops.isa` level (portable,
or AVX-512 for the levels avx512 and amx: ``bi_linear.c``'s two paths, the same bits;
:mod:`lockstep.ops.cbuild`) and loaded after torch, so its ``#pragma omp`` uses torch's own OpenMP
runtime and thread count. Without a C compiler
:func:`available` is false and the tiled-``bmm`` path is used instead (its bits differ from the
kernel's, but one process always uses one of them).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lockstep.ops import isa
from lockstep.ops.cbuild import build_library

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bi_attention.c", "bi_linear.c")]
_FLAGS = ["-O3", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math",
          "-fopenmp", "-fPIC", "-shared"]
#: key positions and value columns are padded to these (the kernel's lane blocks)
KEY_BLOCK = 32
VALUE_BLOCK = 32


def _library() -> ctypes.CDLL | None:
    return _built("avx512" if isa.at_least("avx512") else "portable")


@functools.cache
def _built(level: str) -> ctypes.CDLL | None:
    lib = build_library(f"bi_kernels_{level}", _SOURCES, _FLAGS + isa.march_flags(level),
                        "the batch-invariant C kernels")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.bi_attention_forward.argtypes = [ptr] * 6 + [i64] * 9 + [ctypes.c_float, i64, i64, i64]
    lib.bi_attention_forward.restype = None
    lib.bi_linear.argtypes = [ptr] * 3 + [i64] * 3
    lib.bi_linear.restype = None
    return lib


def available() -> bool:
    """Whether the C kernels could be built and loaded here (decided once per process and level)."""
    return _library() is not None


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                      scale: float, with_lse: bool = False, window: int = 0, keep0: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, T, D]``, ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]``, ``q_positions [B, T]`` ->
    ``[B, H, T, Dv]`` in q's dtype; query ``(b, t)`` attends keys ``0..q_positions[b, t]`` (with
    ``window`` > 0 only the last ``window`` of them, and key 0 as well with ``keep0``: a sink key).
    ``with_lse``: also each row's fp32 log-sum-exp of its scaled scores ``[B, H, T]`` (what SDPA's
    flash backward takes)."""
    lib = _library()
    assert lib is not None, "bi_kernel.attention_forward called without the C kernel"
    bsz, heads, t, d = q.shape
    kv_heads, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    rows = heads // kv_heads * t
    s_pad = -(-s // KEY_BLOCK) * KEY_BLOCK
    dv_pad = -(-dv // VALUE_BLOCK) * VALUE_BLOCK
    q, k, v = q.detach(), k.detach(), v.detach()
    qf = torch.empty(bsz, kv_heads, rows, d, dtype=torch.float32, device=q.device)
    qf.view(bsz, heads, t, d).copy_(q)  # one pass: cast and lay out
    kt = torch.empty(bsz, kv_heads, d, s_pad, dtype=torch.float32, device=q.device)
    kt[..., :s].copy_(k.transpose(2, 3))
    kt[..., s:].zero_()
    if v.dtype == torch.float32 and v.is_contiguous() and (s, dv) == (s_pad, dv_pad):
        vf = v
    else:
        vf = torch.empty(bsz, kv_heads, s_pad, dv_pad, dtype=torch.float32, device=q.device)
        vf[:, :, :s, :dv].copy_(v)
        vf[:, :, s:].zero_()
        vf[..., dv:].zero_()
    pos = q_positions.to(torch.int64).contiguous()
    out = torch.empty(bsz, kv_heads, rows, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, heads, t, dtype=torch.float32, device=q.device) if with_lse else None
    lib.bi_attention_forward(qf.data_ptr(), kt.data_ptr(), vf.data_ptr(), pos.data_ptr(), out.data_ptr(),
                             lse.data_ptr() if lse is not None else None,
                             bsz, kv_heads, rows, t, d, s, s_pad, dv, dv_pad, scale, 4 if rows >= 4 else 1,
                             int(window), int(keep0))
    out = out.view(bsz, heads, t, dv).to(q.dtype)
    return (out, lse) if with_lse else out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [M, K] @ weight [N, K].T -> [M, N]``, each output a fixed-order dot product of
    ``x``'s row and ``weight``'s row read in place (``csrc/bi_linear.c``): no copy of the weight,
    so nothing can go stale when weights are written in place by collectives."""
    lib = _library()
    assert lib is not None, "bi_kernel.linear called without the C kernels"
    x, weight = x.detach().contiguous(), weight.detach().contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    lib.bi_linear(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return out
