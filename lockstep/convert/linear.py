"""Converted linears: torchao's Float8 and MXFP8 training GEMMs behind ``nn.Linear``'s interface.

Both classes keep ``weight`` (and ``bias``) as ordinary full-precision parameters under the same
names, so state dicts, optimizer state, checkpoints and HF export are those of the unconverted model;
only the GEMMs quantise, dynamically, on every call.

- :class:`Float8TrainingLinear`: torchao's ``Float8Linear`` (tensorwise or rowwise recipe);
  ``emulate=True`` on CPU and on GPUs below compute capability 8.9, the real ``_scaled_mm`` kernels
  above.
- :class:`MXFP8TrainingLinear`: torchao's ``mx_mm`` autograd function (the GEMMs of its MXFP8
  training op); the emulated kernel preference with torch casts on CPU and below capability 10.0,
  torchao's AUTO kernels (Triton/CUDA casts, CUTLASS GEMMs) above.

torchao's own autocast handling targets CUDA only (``Float8Linear`` reads the GPU autocast dtype), so
both classes cast the input to the input device's autocast dtype, as ``F.linear`` would be, and run
torchao's function with autocast off (its emulated float32 GEMMs must not be re-cast).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lockstep.convert.quantize import MX_BLOCK


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def cuda_capability_at_least(device: torch.device, major: int, minor: int) -> bool:
    """Whether ``device`` is a CUDA device of compute capability >= (major, minor)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (major, minor)


def float8_linear_class() -> type[nn.Linear]:
    """:class:`Float8TrainingLinear`, defined on first use so importing lockstep does not import torchao."""
    global _FLOAT8_CLASS
    if _FLOAT8_CLASS is None:
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        class Float8TrainingLinear(Float8Linear):
            """torchao's Float8Linear with CPU autocast handled (see the module docstring)."""

            low_precision_format: str = "fp8"

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                dtype = _compute_dtype(input)
                with torch.autocast(input.device.type, enabled=False):
                    out = matmul_with_hp_or_float8_args.apply(input.to(dtype), self.weight.t(),
                                                              self.linear_mm_config, self.config)
                    if self.bias is not None:
                        out = out + self.bias.to(out.dtype)
                return out

        _FLOAT8_CLASS = Float8TrainingLinear
    return _FLOAT8_CLASS


_FLOAT8_CLASS: type[nn.Linear] | None = None


def to_float8_linear(linear: nn.Linear, recipe: str, emulate: bool) -> nn.Linear:
    """``linear`` as a Float8 training linear (``recipe``: "tensorwise" or "rowwise"), sharing its parameters."""
    from torchao.float8.config import Float8LinearConfig

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    module = float8_linear_class().from_float(linear, config=config)
    module.low_precision_format = f"fp8_{recipe}"
    return module


class MXFP8TrainingLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in MXFP8 (e4m3, 32-element blocks, e8m0 RCEIL scales)
    through torchao's ``mx_mm``; ``emulated`` picks torchao's pure-torch kernels."""

    low_precision_format = "mxfp8"
    emulated: bool = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice,
                                                         ScaleCalculationMode)
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        dtype = _compute_dtype(input)
        if self.emulated:
            kernels = (KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH)
        else:
            kernels = (KernelPreference.AUTO, MXFP8Dim0CastKernelChoice.TRITON, MXFP8Dim1CastKernelChoice.CUDA)
        e4m3 = torch.float8_e4m3fn
        shape = input.shape
        rows = input.reshape(-1, shape[-1])
        pad = (-rows.shape[0]) % MX_BLOCK  # the weight-gradient GEMM reduces over tokens in 32-blocks
        with torch.autocast(input.device.type, enabled=False):
            if pad:  # zero rows: no block's scale changes, their outputs are dropped, their gradients are 0
                rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
            out = mx_mm.apply(rows.to(dtype), self.weight.to(dtype), e4m3, e4m3, e4m3, MX_BLOCK, *kernels,
                              ScaleCalculationMode.RCEIL, False)
            if pad:
                out = out[:-pad]
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])


def to_mxfp8_linear(linear: nn.Linear, emulate: bool) -> nn.Linear:
    """``linear`` as an :class:`MXFP8TrainingLinear`, in place (class swap: the parameters stay)."""
    linear.__class__ = MXFP8TrainingLinear
    linear.emulated = emulate
    return linear
