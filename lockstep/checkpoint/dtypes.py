"""torch dtypes <-> the names checkpoints use (torch's in the index, safetensors' codes in shards)."""

from __future__ import annotations

import torch

SAFETENSORS_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in SAFETENSORS_CODES}
DTYPES_BY_NAME = {name: dt for dt, name in DTYPE_NAMES.items()}
