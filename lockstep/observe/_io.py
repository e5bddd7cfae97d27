"""Shared helpers for observe: JSON conversion of training values and atomic file writes.

``to_jsonable`` turns tensors, numpy values, paths, dtypes, enums and dataclasses into plain JSON
types and writes non-finite floats as ``None`` (recording where, so the caller can say so).
``atomic_write_json`` writes through a temp file in the same folder and renames it into place, so a
reader (or a crash) never sees a half-written file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any

import torch

from lockstep.atomic import atomic_open

try:  # numpy is a dependency, but keep observe importable without it.
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def _float(x: float, key: str, nonfinite: list[str] | None) -> float | None:
    if math.isfinite(x):
        return x
    if nonfinite is not None:
        nonfinite.append(key)
    return None


def to_jsonable(value: Any, key: str = "", nonfinite: list[str] | None = None) -> Any:
    """Convert ``value`` to JSON types. Non-finite floats become None and their key path
    (``"a.b"``, ``"xs[2]"``) is appended to ``nonfinite`` when given. Unknown types raise TypeError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _float(float(value), key, nonfinite)
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.numel() == 1:
            return to_jsonable(value.cpu().item(), key, nonfinite)
        return to_jsonable(value.cpu().tolist(), key, nonfinite)
    if np is not None and isinstance(value, np.generic):
        return to_jsonable(value.item(), key, nonfinite)
    if np is not None and isinstance(value, np.ndarray):
        return to_jsonable(value.tolist(), key, nonfinite)
    if isinstance(value, dict):
        return {
            str(k): to_jsonable(v, f"{key}.{k}" if key else str(k), nonfinite)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [to_jsonable(v, f"{key}[{i}]", nonfinite) for i, v in enumerate(items)]
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, key, nonfinite)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return to_jsonable(fields, key, nonfinite)
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    raise TypeError(f"cannot convert {key or 'value'} of type {type(value).__name__} to JSON")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`lockstep.atomic.atomic_open`), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path) as f:
        f.write(text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` (already JSON-compatible) as indented strict JSON, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")
