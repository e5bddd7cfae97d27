"""Process-wide numerics switches: batch-invariant mode.

In batch-invariant mode a sequence's logits and log-probabilities do not depend on the batch it
is computed in (size, order, the other sequences, padding) or on whether keys and values come
from a KV cache: the trainer's full-sequence scoring and the generation engine's prefill/decode
give bitwise-identical log-probabilities. ``docs/numerics.md`` states the promise and its scope.

    from lockstep import numerics
    numerics.set_batch_invariant(True)          # what a recipe's numerics.batch_invariant does
    with numerics.batch_invariant():            # or for a block
        ...

The switch is read at call time: attention layers resolve their kernel from it on every call
(:func:`lockstep.ops.attention.resolve_backend`), and so do MLA's absorbed path and per-head
projections, MoE expert matmuls and routers, and the linear layers that :func:`prepare_model`
converts; a model built before the switch was set follows it too. Tensor-parallel layers (DTensor
weights) run the invariant kernels on their local shards (:mod:`lockstep.ops.tp_invariant`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from lockstep.config.base import Config

_BATCH_INVARIANT = False


def set_batch_invariant(enabled: bool) -> None:
    """Turn batch-invariant kernels on or off for this process."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = bool(enabled)


def is_batch_invariant() -> bool:
    return _BATCH_INVARIANT


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Batch-invariant mode inside the block; the previous setting is restored after it."""
    previous = _BATCH_INVARIANT
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


class SwitchableLinear(nn.Linear):
    """An ``nn.Linear`` whose forward uses the batch-invariant matmul while the switch is on.

    Same parameters, names and state dict as the ``nn.Linear`` it replaces (only the class changes),
    so checkpoints, HF conversion and parallel plans see no difference. ``k_split`` (set per layer by
    :func:`lockstep.parallel.tp_sums.split_row_parallel_sums`): the invariant matmul sums K in that
    many slices, as a row-parallel layer of another tensor-parallel degree does."""

    k_split: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _BATCH_INVARIANT:
            from lockstep.ops.batch_invariant import linear

            return linear(x, self.weight, self.bias, self.k_split)
        return super().forward(x)


def prepare_model(model: nn.Module) -> nn.Module:
    """Make ``model``'s linear layers follow the switch: each ``nn.Linear`` becomes a
    :class:`SwitchableLinear`, which reads the switch per call (idempotent, cheap; once per model
    suffices, before FSDP changes module classes). Everything else reads the switch itself,
    attention layers included (:mod:`lockstep.ops.attention`)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SwitchableLinear
    return model


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, batch-invariant while the switch is on (for model code that calls it directly)."""
    if _BATCH_INVARIANT:
        from lockstep.ops.batch_invariant import linear as invariant_linear

        return invariant_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, K] @ weight [H, K, N]`` per head; batch-invariant while the switch is on."""
    if _BATCH_INVARIANT:
        from lockstep.ops.batch_invariant import head_matmul as invariant_head_matmul

        return invariant_head_matmul(x, weight)
    return torch.einsum("bhtk,hkn->bhtn", x, weight)


def rowwise(fn, x: torch.Tensor, multiple: int = 64) -> torch.Tensor:
    """``fn(x)`` for an elementwise transcendental (silu, sigmoid, exp, ...) over ``x [..., D]``:
    while the switch is on, :func:`lockstep.ops.batch_invariant.elementwise` (every element through
    the same vector code, so a row's bits do not depend on its place); off, ``fn(x)``."""
    if not _BATCH_INVARIANT:
        return fn(x)
    from lockstep.ops.batch_invariant import elementwise

    return elementwise(fn, x, multiple)


def thread_settings() -> dict:
    """What a bitwise promise depends on in this process (recorded in run manifests): the C
    kernels (attention forward, fp32 linear) and the tiled fallback agree with themselves, not with
    each other (``batch_invariant_attention`` keeps its name for older manifests; it names both)."""
    out = {"batch_invariant": _BATCH_INVARIANT, "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if _BATCH_INVARIANT:
        from lockstep.ops import bi_kernel

        out["batch_invariant_attention"] = "c_kernel" if bi_kernel.available() else "tiled_fallback"
    return out


@dataclasses.dataclass(kw_only=True)
class NumericsConfig(Config):
    """Numerics choices of a run."""

    #: batch-invariant kernels for the whole run (trainer and generator): bitwise-equal
    #: log-probabilities whatever the batch; see docs/numerics.md for the scope
    batch_invariant: bool = False

    def build(self) -> None:
        set_batch_invariant(self.batch_invariant)
