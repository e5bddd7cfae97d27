"""bf16 linear on Intel AMX tiles for decode-sized calls (``csrc/amx_linear.c``), via ctypes.

The generation engine's packed linears (:mod:`lockstep.generate.packed`) use it where this CPU has
AMX: a decode step's products stream each weight once, and this kernel reads its tile layout at
~1.4x the speed of oneDNN's prepacked linear on SmolLM2's shapes (``benchmarks/decode_kernels.py``).
Products and sums are fp32, one bf16 rounding at the end, in an order fixed by K alone (the C
file's header), so a row's result does not depend on the other rows of the call; it is not
bit-identical to ``F.linear`` (oneDNN sums in another order).

:func:`available` is true on Linux x86 CPUs with ``amx_bf16``, a C compiler, and the kernel's
permission request granted; :func:`supports` says which shapes it takes (``K % 32 == 0``,
``N % 16 == 0``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lockstep.ops.cbuild import build_library, cpu_flags

_SOURCE = Path(__file__).parent / "csrc" / "amx_linear.c"
_FLAGS = ["-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-mavx512bf16", "-fopenmp", "-fPIC", "-shared"]
K_BLOCK = 32
N_BLOCK = 16


@functools.cache
def _library() -> ctypes.CDLL | None:
    flags = cpu_flags().split()
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(flags):
        return None
    lib = build_library("amx_linear", [_SOURCE], _FLAGS, "the AMX linear kernel")
    if lib is None or lib.amx_request_permission() != 0:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_pack.argtypes = [ptr, ptr, i64, i64]
    lib.amx_pack.restype = None
    lib.amx_linear.argtypes = [ptr] * 4 + [i64] * 3
    lib.amx_linear.restype = None
    return lib


def available() -> bool:
    """Whether the AMX kernel runs here (decided once per process)."""
    return _library() is not None


def supports(out_features: int, in_features: int) -> bool:
    """Whether a ``[out_features, in_features]`` weight fits the kernel's tile blocks."""
    return out_features % N_BLOCK == 0 and in_features % K_BLOCK == 0 and out_features > 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[N, K]`` weight in the kernel's tile layout (a new flat tensor of N*K elements)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or not supports(n, k):
        raise ValueError(f"amx_linear.pack: needs a bf16 [N, K] weight with N % {N_BLOCK} == 0 and "
                         f"K % {K_BLOCK} == 0, got {tuple(weight.shape)} {weight.dtype}")
    weight = weight.detach().contiguous()
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    _library().amx_pack(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``x [..., K] @ W.T (+ bias)`` on ``packed = pack(W)``; ``bias`` is fp32 ``[N]`` or None."""
    if not x.is_contiguous():
        x = x.contiguous()
    out = x.new_empty((*x.shape[:-1], out_features))
    rows = out.numel() // out_features if out_features else 0
    if rows:  # per call: ~1 us of Python here (the engine makes ~120 of these a decode step)
        _library().amx_linear(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                              out.data_ptr(), rows, out_features, x.shape[-1])
    return out
