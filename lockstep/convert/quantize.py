"""Lockstep's own low-precision GEMM emulation in plain torch, for the MoE grouped experts.

torchao emulates FP8 and MXFP8 for ``nn.Linear`` but not for the grouped GEMM of MoE experts on CPU,
so the experts' GEMMs run through :class:`EmulatedLowPrecisionMM`: each operand is quantised and
dequantised (``qdq``) along the GEMM's reduction dim with the format's scaling, then multiplied in
float32, in the forward and in both backward GEMMs -- the same math as torchao's emulated paths
(``Float8Linear(emulate=True)``, ``mx_mm`` with the emulated kernel preference; tests/convert checks
the qdq against torchao's casts):

- ``fp8_tensorwise``: one scale per tensor, e4m3 for input and weight, e5m2 for the output gradient.
- ``fp8_rowwise``: one scale per row along the reduction dim, e4m3 everywhere, power-of-2 scales.
- ``mxfp8``: one e8m0 (power-of-2) scale per 32 elements along the reduction dim (RCEIL rounding),
  e4m3 elements; a reduction dim that is not a multiple of 32 is zero-padded (zeros change no block's
  amax nor any product), as the token dim of an expert's weight-gradient GEMM usually is.
"""

from __future__ import annotations

import torch

FORMATS = ("fp8_tensorwise", "fp8_rowwise", "mxfp8")
MX_BLOCK = 32
_EPS = 1e-12  # torchao.float8.float8_utils.EPS: amax floor of an all-zero row
_E8M0_MIN_EXP = -127


def _pow2_floor(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(scale)))


def fp8_qdq(x: torch.Tensor, dim: int | None, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """``x`` cast to ``dtype`` (an fp8 type) and back in float32: scale ``max / amax`` over the whole
    tensor (``dim=None``) or along ``dim`` (one scale per slice), saturated like torchao."""
    xf = x.float()
    amax = xf.abs().amax() if dim is None else xf.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.double().clamp(min=_EPS)).float()  # float64 division, as torchao does
    if pow2:
        scale = _pow2_floor(scale)
    q = (xf * scale).clamp(-fmax, fmax).to(dtype)
    return q.float() / scale


def mx_qdq(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` as MXFP8 (e4m3 elements, one e8m0 scale per 32 along ``dim``, RCEIL) and back in float32."""
    xf = x.float().movedim(dim, -1)
    k = xf.shape[-1]
    pad = (-k) % MX_BLOCK
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    blocks = xf.reshape(*xf.shape[:-1], -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    # RCEIL: the smallest power of two d with amax / d <= max (a zero block takes the smallest scale)
    exp = torch.ceil(torch.log2(amax / fmax)).clamp(min=_E8M0_MIN_EXP, max=127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, _E8M0_MIN_EXP))
    descale = torch.exp2(exp)
    q = (blocks / descale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    out = (q.float() * descale).reshape(xf.shape)
    if pad:
        out = out[..., :k]
    return out.movedim(-1, dim)


def qdq(x: torch.Tensor, fmt: str, dim: int, role: str) -> torch.Tensor:
    """``x`` quantised and dequantised (float32) as GEMM operand ``role`` ("input", "weight" or
    "grad") reduced along ``dim``, in format ``fmt``."""
    if fmt == "fp8_tensorwise":
        return fp8_qdq(x, None, torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn)
    if fmt == "fp8_rowwise":
        return fp8_qdq(x, dim, torch.float8_e4m3fn, pow2=True)
    if fmt == "mxfp8":
        return mx_qdq(x, dim)
    raise ValueError(f"unknown low-precision format {fmt!r}; choose from {FORMATS}")


class EmulatedLowPrecisionMM(torch.autograd.Function):
    """``x [M, K] @ w[N, K].T`` with all three GEMMs (output, grad input, grad weight) on quantised
    operands, each scaled along its own reduction dim; results in ``x``'s dtype, weights' gradient in
    ``w``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.fmt = fmt
        out = qdq(x, fmt, 1, "input") @ qdq(w, fmt, 1, "weight").t()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        fmt = ctx.fmt
        grad_x = qdq(grad, fmt, 1, "grad") @ qdq(w, fmt, 0, "weight")  # reduces over N
        grad_w = qdq(grad, fmt, 0, "grad").t() @ qdq(x, fmt, 0, "input")  # reduces over M (tokens)
        return grad_x.to(x.dtype), grad_w.to(w.dtype), None


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) through :class:`EmulatedLowPrecisionMM`; under autocast the
    operands are cast to the autocast dtype first (as ``F.linear`` would be) and the emulation itself
    runs outside autocast, so its float32 GEMMs are not re-cast."""
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    shape = x.shape
    with torch.autocast(x.device.type, enabled=False):
        out = EmulatedLowPrecisionMM.apply(x.reshape(-1, shape[-1]).to(dtype), weight.to(dtype), fmt)
    return out.reshape(*shape[:-1], weight.shape[0])
