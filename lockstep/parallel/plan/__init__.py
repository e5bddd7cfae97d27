"""``lockstep plan``: a scale dry run that sizes a cluster job from a laptop.

The model is built on the meta device (no memory is allocated, so DeepSeek-V3-671B works on a
laptop) and every parameter is placed by its module, under the layout

    world = pp x dp_replicate x dp_shard x cp x tp   (ep is carved out of dp_shard, or spans dp_shard x cp)

The report gives the per-rank memory of every pipeline rank, details the worst one (largest
memory) with its collectives per optimizer step and the pipeline bubble, says when lockstep's
trainer refuses the layout (and why), and with ``--verify-fsdp`` checks the plan's shard shapes
against a real sharded build under a fake process group (the trainer's own parallelize code).

This module is the public entry point; the work is split by job, one module each:

* :mod:`lockstep.parallel.plan.layout`: :class:`Layout` and :func:`place_parameters` (which stage,
  FSDP unit and TP / EP / FSDP split each parameter gets).
* :mod:`lockstep.parallel.plan.memory`: activation bytes per block, FSDP units and their transient.
* :mod:`lockstep.parallel.plan.collectives`: :class:`Collective` and the collectives of one step.
* :mod:`lockstep.parallel.plan.schedule`: micro-batches, :func:`pipeline_bubble`, the trainer's refusal.
* :mod:`lockstep.parallel.plan.build`: :class:`StagePlan`, :class:`Plan` and :func:`build_plan`.
* :mod:`lockstep.parallel.plan.report`: the text report (:func:`fmt_bytes`).
* :mod:`lockstep.parallel.plan.verify`: :func:`verify_fsdp` (``--verify-fsdp``).
* :mod:`lockstep.parallel.plan.cli`: :func:`cmd_plan` and ``python -m lockstep.parallel.plan``.

Use :func:`build_plan` from Python, or ``cmd_plan(argv)`` (``lockstep plan``).
"""

from __future__ import annotations

from lockstep.parallel.pipeline import layer_ranges  # the split the runner uses
from lockstep.parallel.plan.build import Plan, StagePlan, build_meta_model, build_plan
from lockstep.parallel.plan.cli import cmd_plan, main, plan_from_args
from lockstep.parallel.plan.collectives import Collective
from lockstep.parallel.plan.report import fmt_bytes
from lockstep.parallel.plan.layout import (AC_MODES, DTYPE_BYTES, ROOT_UNIT, SCHEDULES, Layout, ParamPlacement,
                                           place_parameters)
from lockstep.parallel.plan.memory import block_activation_bytes
from lockstep.parallel.plan.schedule import lockstep_refusal, pipeline_bubble
from lockstep.parallel.plan.verify import verify_fsdp

__all__ = [
    "AC_MODES", "DTYPE_BYTES", "ROOT_UNIT", "SCHEDULES", "Collective", "Layout", "ParamPlacement", "Plan",
    "StagePlan", "block_activation_bytes", "build_meta_model", "build_plan", "cmd_plan", "fmt_bytes",
    "layer_ranges", "lockstep_refusal", "main", "pipeline_bubble", "place_parameters", "plan_from_args", "verify_fsdp",
]
