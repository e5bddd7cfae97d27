"""MXFP4 expert weights of the released GPT-OSS checkpoints, dequantised on load.

The hub checkpoints (``quantization_config.quant_method: mxfp4``) store each expert projection as
``{proj}_blocks`` (uint8 ``[E, rows, G, 16]``: two FP4 e2m1 codes per byte, low nibble first) and
``{proj}_scales`` (uint8 ``[E, rows, G]``: a shared power of two per 32 values, biased by 127).
``rows`` are the projection's outputs and ``G * 32`` its inputs; the dequantised tensor is
transposed to transformers' in-memory layout ``[E, inputs, outputs]`` (``gate_up_proj [E, D, 2F]``,
``down_proj [E, F, D]``). Op for op transformers' ``integrations.mxfp4.convert_moe_packed_tensors``
(tested bitwise); every value is exactly representable, so the result does not depend on the dtype
beyond range.
"""

from __future__ import annotations

import torch

#: the 16 FP4 (e2m1) values by code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [E, rows, G, B]`` uint8 and ``scales [E, rows, G]`` -> ``[E, G * B * 2, rows]`` in ``dtype``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match")
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, width = blocks.shape
    values = torch.empty(*prefix, groups, width * 2, dtype=dtype, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1)).to(dtype)
    return values.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()
