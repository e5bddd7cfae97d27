"""Pipeline schedule pieces of a ``lockstep plan`` dry run, and the trainer's own verdict on a layout.

* :func:`_microbatches`: micro-batches per step, the trainer's default (pp x stages per rank) and
  rules (:func:`lockstep.parallel.pipeline.validate_pipeline`);
* :func:`pipeline_bubble`: the idle fraction of a step per schedule, with the time model it assumes;
* :func:`lockstep_refusal`: why lockstep's :class:`ParallelConfig` refuses a layout ('' if it runs it).
"""

from __future__ import annotations

from typing import Any

from lockstep.parallel.plan.layout import Layout, flag_error


def _microbatches(layout: Layout, batch: int, microbatches: int | None, schedule: str, n_layers: int) -> int:
    """Micro-batches per step (default: the fewest the schedule accepts that divide the local batch),
    checked by the runner's own :func:`validate_pipeline`."""
    from lockstep.parallel.pipeline import stages_per_rank, validate_pipeline

    local = batch // layout.dp
    if layout.pp == 1:
        if microbatches is not None and (microbatches < 1 or local % microbatches):
            flag_error("--microbatches", f"{microbatches} does not divide the {local} sequences per data-parallel rank")
        return microbatches or 1
    if microbatches is None:
        need = layout.pp * stages_per_rank(schedule)  # the trainer's default (pp x stages per rank)
        candidates = [need] + [m for m in range(local, 0, -1) if local % m == 0]
        for m in candidates:
            try:
                validate_pipeline(schedule, layout.pp, m, None, local)
            except ValueError:
                continue
            microbatches = m
            break
        else:
            flag_error("--batch-size", f"{batch} gives {local} sequence(s) per data-parallel rank: no micro-batch "
                       f"count {schedule} accepts at pp={layout.pp} divides it (the default is {need})")
    if microbatches < 1:
        flag_error("--microbatches", f"must be >= 1, got {microbatches}")
    try:
        validate_pipeline(schedule, layout.pp, microbatches, n_layers, local)
    except ValueError as err:
        flag_error("--microbatches" if "n_microbatches" in str(err) else "--pp", str(err).removeprefix("pp: "))
    return microbatches


def pipeline_bubble(schedule: str, pp: int, microbatches: int) -> dict[str, Any]:
    """Idle fraction of a pipeline step under ``schedule``, with the time model it assumes.

    Times per micro-batch and stage: forward F, backward B (input grads) + W (weight grads), taken
    equal (F = B = W, so a full backward is 2F). GPipe / 1F1B: ``(pp-1)(F+B+W)`` idle against
    ``M(F+B+W)`` busy; Interleaved1F1B with v stages per rank: the same idle against ``vM`` busy
    stage slots; ZBV (zero-bubble V) idles ``(pp-1)(F+B-2W)`` and DualPipeV ``(pp-1)(F&B+B-3W)``
    with F&B = F+B (no compute overlap): 0 under F = B = W.
    """
    from lockstep.parallel.pipeline import stages_per_rank

    if pp == 1:
        return {"fraction": 0.0, "formula": "no pipeline", "assumes": ""}
    v = stages_per_rank(schedule)
    F = B = W = 1.0
    busy = microbatches * v * (F + B + W)
    if schedule in ("GPipe", "1F1B"):
        idle, formula = (pp - 1) * (F + B + W), "(pp-1) / (M + pp-1)"
    elif schedule == "Interleaved1F1B":
        idle, formula = (pp - 1) * (F + B + W), f"(pp-1) / (v*M + pp-1), v={v}"
    elif schedule == "ZBVZeroBubble":
        idle, formula = (pp - 1) * (F + B - 2 * W), "(pp-1)(F+B-2W) idle, 0 at F=B=W"
    else:  # DualPipeV
        idle, formula = (pp - 1) * ((F + B) + B - 3 * W), "(pp-1)(F&B+B-3W) idle, 0 at F=B=W and F&B=F+B"
    return {"fraction": idle / (busy + idle), "formula": formula,
            "assumes": "per-stage times F = B = W (backward = 2 x forward, split into input and weight grads)"}


def lockstep_refusal(layout: Layout, schedule: str = "1F1B", cp_method: str = "allgather") -> str:
    """Why lockstep's own :class:`ParallelConfig` refuses ``layout`` ('' when it accepts it)."""
    from lockstep.config.base import ConfigError
    from lockstep.parallel.dims import ParallelConfig

    pcfg = ParallelConfig(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp, ep=layout.ep,
                          cp=layout.cp, pp=layout.pp, pp_schedule=schedule, cp_method=cp_method)
    try:
        pcfg.validate()
        pcfg.resolve(layout.world)
    except ConfigError as err:
        return str(err)
    return ""
