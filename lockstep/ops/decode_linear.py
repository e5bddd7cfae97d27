"""Linears on prepacked weights as C kernels (ctypes), picked by the CPU's :mod:`~lockstep.ops.isa` level.

bf16, one packed layout (``csrc/bf16_linear.c``'s ``bf16_pack``) read by every bf16 kernel:

- level ``amx``: Intel AMX tiles (``csrc/amx_linear.c``) for weights that fill whole tiles
  (``N % 16 == 0``, ``K % 32 == 0``); other shapes take the next kernel;
- ``avx512`` with ``avx512_bf16`` (and amx, for the other shapes): ``vdpbf16ps``'s arithmetic, run as
  fp32 FMAs under DAZ/FTZ (``csrc/bf16_linear.c``: the same bits, faster than the instruction);
- below that: the same file's plain C path, the same bits again (its header).

fp32 (``csrc/f32_linear.c``): AVX-512, levels avx512 and amx, ``N % 16 == 0``.

Users: the generation engine's packed linears (:mod:`lockstep.generate.packed`: a decode step streams
each weight once, and these kernels read their layouts faster than oneDNN's prepacked bf16 linear on
AMX (~1.5x) and the BLAS behind fp32 ``F.linear`` (~1.4x), ``benchmarks/decode_kernels.py``), and the
batch-invariant bf16 linear (:mod:`lockstep.ops.batch_invariant`). Every kernel sums in fp32 in an
order fixed by K alone (each C file's header), so a row's result does not depend on the other rows
of the call; none is bit-identical to ``F.linear``, and AMX and ``vdpbf16ps`` differ from each
other: a process at one level uses one kernel per weight shape everywhere.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lockstep.ops import isa
from lockstep.ops.cbuild import build_library

_CSRC = Path(__file__).parent / "csrc"
_COMMON = ["-O3", "-fopenmp", "-fPIC", "-shared"]
N_BLOCK = 16
#: the AMX kernel's k block (bf16 pairs of 16 rows of a tile)
AMX_K_BLOCK = 32
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _typed(fn, n_ptr: int, n_int: int):
    fn.argtypes, fn.restype = [_PTR] * n_ptr + [_I64] * n_int, None
    return fn


@functools.cache
def _bf16_library(level: str) -> tuple | None:
    """The (pack, linear) functions of ``bf16_linear.c`` built for ``level``, or None without a compiler."""
    lib = build_library(f"bf16_linear_{level}", [_CSRC / "bf16_linear.c"],
                        _COMMON + isa.march_flags(level) + ["-ffp-contract=off", "-fno-fast-math"],
                        "the bf16 linear kernel")
    return None if lib is None else (_typed(lib.bf16_pack, 2, 2), _typed(lib.bf16_linear, 4, 3))


@functools.cache
def _amx_library():
    """``amx_linear`` (AMX tile state granted), or None."""
    lib = build_library("amx_linear", [_CSRC / "amx_linear.c"],
                        _COMMON + isa.march_flags("amx") + ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"],
                        "the AMX linear kernel")
    if lib is None or lib.amx_request_permission() != 0:
        return None
    return _typed(lib.amx_linear, 4, 3)


@functools.cache
def _f32_library() -> tuple | None:
    lib = build_library("f32_linear", [_CSRC / "f32_linear.c"], _COMMON + isa.march_flags("avx512"),
                        "the fp32 linear kernel")
    return None if lib is None else (_typed(lib.f32_pack, 2, 2), _typed(lib.f32_linear, 4, 3))


def amx_fits(out_features: int, in_features: int) -> bool:
    """Whether a bf16 ``[out_features, in_features]`` weight fills the AMX kernel's tiles."""
    return out_features > 0 and out_features % N_BLOCK == 0 and in_features % AMX_K_BLOCK == 0


def kernel(dtype: torch.dtype = torch.bfloat16, out_features: int = N_BLOCK, in_features: int = AMX_K_BLOCK) -> str | None:
    """Which kernel a ``dtype [out_features, in_features]`` weight runs at the current level:
    "amx", "avx512_bf16", "portable_bf16", "avx512_f32", or None (none here)."""
    level = isa.level()
    if dtype == torch.float32:
        return "avx512_f32" if isa.at_least("avx512") and _f32_library() is not None else None
    if dtype != torch.bfloat16 or _bf16_library(level) is None:
        return None
    if level == "amx" and amx_fits(out_features, in_features) and _amx_library() is not None:
        return "amx"
    return "avx512_bf16" if isa.avx512_bf16() else "portable_bf16"


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``dtype``'s kernels run here at the current level (a C compiler; fp32: AVX-512)."""
    return kernel(dtype) is not None


def amx_available() -> bool:
    """Whether whole-tile bf16 weights run on AMX here (level amx, the OS granting tile state)."""
    return kernel(torch.bfloat16) == "amx"


def supports(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a ``[out_features, in_features]`` weight of ``dtype`` fits the kernels' layout (bf16:
    any shape; fp32: ``N % 16 == 0``)."""
    if dtype == torch.bfloat16:
        return out_features > 0 and in_features > 0
    return dtype == torch.float32 and out_features > 0 and out_features % N_BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 or fp32 ``[N, K]`` weight in its kernels' layout (a new flat tensor; bf16: N and K
    padded with zeros to multiples of 16 and 32)."""
    n, k = weight.shape
    if not supports(n, k, weight.dtype):
        raise ValueError(f"decode_linear.pack: needs a non-empty bf16 [N, K] weight, or an fp32 one with "
                         f"N % {N_BLOCK} == 0; got {tuple(weight.shape)} {weight.dtype}")
    weight = weight.detach().contiguous()
    if weight.dtype == torch.float32:
        packed = torch.empty(n * k, dtype=weight.dtype)
        _f32_library()[0](weight.data_ptr(), packed.data_ptr(), n, k)
        return packed
    packed = torch.empty(-(-n // N_BLOCK) * N_BLOCK * -(-k // AMX_K_BLOCK) * AMX_K_BLOCK, dtype=weight.dtype)
    _bf16_library(isa.level())[0](weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


@functools.cache
def _kernel_fn(level: str, dtype: torch.dtype, out_features: int, in_features: int):
    """The ctypes function running a ``dtype [out_features, in_features]`` pack at ``level`` (resolved
    once per shape: a decode step makes ~120 calls, each of which re-resolved it before)."""
    if dtype == torch.float32:
        return _f32_library()[1]
    fn = _amx_library() if level == "amx" and amx_fits(out_features, in_features) else None
    return fn or _bf16_library(level)[1]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` on ``packed = pack(W)`` (x in W's dtype); ``bias`` is fp32
    ``[N]`` or None."""
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    out = x.new_empty((*x.shape[:-1], out_features))
    rows = out.numel() // out_features if out_features else 0
    if rows:
        _kernel_fn(isa.level(), x.dtype, out_features, k)(
            x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(), rows,
            out_features, k)
    return out


def kernel_address(dtype: torch.dtype, out_features: int, in_features: int) -> int:
    """The address of the C function :func:`linear` calls for a ``dtype [out_features, in_features]``
    pack at the current level (what a C++ caller invokes directly, with :func:`linear`'s arguments)."""
    return ctypes.cast(_kernel_fn(isa.level(), dtype, out_features, in_features), ctypes.c_void_p).value
