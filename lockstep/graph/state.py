"""Whether a graph capture is tracing right now: model code skips host reads (bound checks that read a
tensor value) and picks shape-static paths while it is, as it does under ``torch.compile``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_capturing = False


def is_capturing() -> bool:
    """True inside :func:`capturing` (a graph capture) or while ``torch.compile`` traces."""
    return _capturing or torch.compiler.is_compiling()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Mark the body as a graph capture (see :func:`is_capturing`)."""
    global _capturing
    previous, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = previous
