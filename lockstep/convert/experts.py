"""MoE grouped experts in low precision: lockstep's emulated GEMMs (:mod:`lockstep.convert.quantize`).

A converted ``GroupedExperts`` instance has its class swapped for :class:`LowPrecisionExperts`: the
same parameters (``w1``, ``w2``, ``w3``, biases) under the same names, and a forward that runs each
expert's three GEMMs through :func:`~lockstep.convert.quantize.emulated_linear`. One GEMM per expert
is what makes the scaling of each weight-gradient GEMM per group (the tokens of one expert), as a
grouped FP8 / MXFP8 kernel scales it. The model code is unaware: the routing (gather, weighted
combine) stays in ``MoE``, because this class does not take it (``takes_routing = False``).
"""

from __future__ import annotations

import functools

import torch

from lockstep.convert.quantize import emulated_linear
from lockstep.models.common.moe import GroupedExperts


class LowPrecisionExperts(GroupedExperts):
    """GroupedExperts whose GEMMs run in ``low_precision_format``, emulated in torch."""

    takes_routing = False
    low_precision_format: str = "mxfp8"

    def forward(self, x: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor | None = None,
                token: torch.Tensor | None = None) -> torch.Tensor:
        if row_weights is not None or token is not None:
            raise ValueError("LowPrecisionExperts: the routing stays in MoE (row_weights / token are not taken)")
        return self._loop(x, counts, functools.partial(emulated_linear, fmt=self.low_precision_format))


def to_low_precision_experts(experts: GroupedExperts, fmt: str) -> GroupedExperts:
    """``experts`` converted in place (class swap) to run its GEMMs in ``fmt``."""
    experts.__class__ = LowPrecisionExperts
    experts.low_precision_format = fmt
    return experts
