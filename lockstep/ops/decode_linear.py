"""Linears for decode-sized calls on prepacked weights, as C kernels (ctypes): bf16 on Intel AMX
tiles (``csrc/amx_linear.c``), fp32 on AVX-512 (``csrc/f32_linear.c``).

The generation engine's packed linears (:mod:`lockstep.generate.packed`) use them: a decode step's
products stream each weight once, and these kernels read their packed layouts faster than oneDNN's
prepacked bf16 linear (~1.5x on a SmolLM2 step's weights) and the BLAS behind fp32 ``F.linear``
(~1.4x) (``benchmarks/decode_kernels.py``). Sums are fp32 in an order fixed by K alone (each C
file's header), so a row's result does not depend on the other rows of the call; neither is
bit-identical to ``F.linear``. bf16: products of bf16 pairs summed in fp32, bias added in fp32,
one bf16 rounding.

:func:`available` says whether a dtype's kernel runs here (bf16: Linux x86 with ``amx_bf16``, and
the OS granting AMX state; fp32: ``avx512f``; both: a C compiler); :func:`supports` which shapes
it takes (``N % 16 == 0``; bf16 also ``K % 32 == 0``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lockstep.ops.cbuild import build_library, cpu_flags

_CSRC = Path(__file__).parent / "csrc"
_COMMON = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
#: dtype -> (source, extra flags, CPU flags needed, C symbol prefix)
_KERNELS = {
    torch.bfloat16: ("amx_linear.c", ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"],
                     {"amx_bf16", "amx_tile", "avx512_bf16"}, "amx"),
    torch.float32: ("f32_linear.c", [], {"avx512f"}, "f32"),
}
K_BLOCK = {torch.bfloat16: 32, torch.float32: 1}
N_BLOCK = 16


@functools.cache
def _library(dtype: torch.dtype) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """``dtype``'s (pack, linear) C functions, or None where they cannot run."""
    source, flags, needed, prefix = _KERNELS[dtype]
    if not needed <= set(cpu_flags().split()):
        return None
    lib = build_library(prefix + "_linear", [_CSRC / source], _COMMON + flags, f"the {prefix} linear kernel")
    if lib is None or (dtype == torch.bfloat16 and lib.amx_request_permission() != 0):
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    pack_fn, linear_fn = getattr(lib, prefix + "_pack"), getattr(lib, prefix + "_linear")
    pack_fn.argtypes, pack_fn.restype = [ptr, ptr, i64, i64], None
    linear_fn.argtypes, linear_fn.restype = [ptr] * 4 + [i64] * 3, None
    return pack_fn, linear_fn


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``dtype``'s kernel runs here (decided once per process)."""
    return dtype in _KERNELS and _library(dtype) is not None


def supports(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a ``[out_features, in_features]`` weight of ``dtype`` fits the kernel's blocks."""
    return (dtype in _KERNELS and out_features > 0 and out_features % N_BLOCK == 0
            and in_features % K_BLOCK[dtype] == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 or fp32 ``[N, K]`` weight in its kernel's layout (a new flat tensor of N*K elements)."""
    n, k = weight.shape
    if not supports(n, k, weight.dtype):
        raise ValueError(f"decode_linear.pack: needs a bf16 [N, K] weight with N % {N_BLOCK} == 0 and "
                         f"K % {K_BLOCK[torch.bfloat16]} == 0, or an fp32 one with N % {N_BLOCK} == 0; "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    weight = weight.detach().contiguous()
    packed = torch.empty(n * k, dtype=weight.dtype)
    _library(weight.dtype)[0](weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` on ``packed = pack(W)`` (x in W's dtype); ``bias`` is fp32
    ``[N]`` or None."""
    if not x.is_contiguous():
        x = x.contiguous()
    out = x.new_empty((*x.shape[:-1], out_features))
    rows = out.numel() // out_features if out_features else 0
    if rows:  # per call: ~1 us of Python here (the engine makes ~120 of these a decode step)
        _library(x.dtype)[1](x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                             out.data_ptr(), rows, out_features, x.shape[-1])
    return out
