"""Batch-invariant RL across unlike tensor-parallel degrees: which side splits its row-parallel sums.

A trainer at ``parallel.tp = a`` and generators at ``workers.generator_parallel.tp = b`` form the same
row-parallel sums (``wo``, ``w2``) only when ``a == b``. When one degree divides the other by a power of
two, the smaller-degree side's model sums K in ``max / min`` slices
(:func:`lockstep.parallel.tp_sums.split_row_parallel_sums`) and computes the larger degree's bits, so
trainer and generator log-probabilities stay bitwise equal (docs/numerics.md, "Batch-invariant mode
across generator layouts"). Every process derives the same :class:`TPSplit` from the config and the
model's architecture; the trainer's manifest records it (``numerics.tp_split``).

Only in batch-invariant mode (the split runs the slower unpacked kernel); families whose blocks the
split refuses (MoE, MLA) run unsplit, off by rounding, which the start-up note says.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from lockstep.parallel.tp_sums import split_refusal, split_row_parallel_sums
from lockstep.rl.config import RLConfig


@dataclasses.dataclass(frozen=True)
class TPSplit:
    """How many slices the trainer's and the generators' row-parallel sums are split into (1: not split)."""

    trainer_tp: int
    generator_tp: int
    trainer: int = 1
    generator: int = 1
    #: what holds between trainer and generator sums; None where there is nothing to say (the same
    #: degree, no generators, batch-invariant mode off)
    note: str | None = None

    def describe(self) -> dict:
        """The manifest's ``numerics.tp_split``."""
        return dataclasses.asdict(self)

    def apply(self, model: nn.Module, side: str) -> nn.Module:
        """Split ``model``'s sums as ``side`` ("trainer" or "generator") does; returns it."""
        n = self.trainer if side == "trainer" else self.generator
        return split_row_parallel_sums(model, n) if n > 1 else model


def plan_tp_split(config: RLConfig, model: nn.Module) -> TPSplit:
    """The split of a job whose model has ``model``'s architecture (module docstring)."""
    a, b = config.parallel.tp, config.workers.generator_parallel.tp
    plain = TPSplit(trainer_tp=a, generator_tp=b)
    if not config.numerics.batch_invariant or not config.workers.generators or a == b:
        return plain
    off = f"trainer tp={a}, generator tp={b}: row-parallel sums not split, log-probabilities off by rounding"
    if config.workers.engine == "vllm":
        return dataclasses.replace(plain, note=f"{off} (vLLM generators run their own kernels)")
    low, high = min(a, b), max(a, b)
    ratio = high // low
    if high % low or ratio & (ratio - 1):
        return dataclasses.replace(plain, note=f"{off} (the degrees differ by {high}/{low}, not a power of two)")
    refusal = split_refusal(model)
    if refusal is not None:
        return dataclasses.replace(plain, note=f"{off} ({refusal})")
    side = "trainer" if a < b else "generator"
    return dataclasses.replace(plain, **{side: ratio},
                               note=f"trainer tp={a}, generator tp={b}: the {side}'s row-parallel sums are split "
                                    f"{ratio} ways (tp={high}'s order), log-probabilities bitwise equal")
