"""The text report of a ``lockstep plan`` dry run (``--json`` prints :meth:`Plan.to_dict` instead)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lockstep.parallel.plan.layout import DTYPE_BYTES

if TYPE_CHECKING:
    from lockstep.parallel.plan.build import Plan


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def format_plan(plan: Plan) -> str:
    """The text report of ``plan`` (every stage, the worst one in detail, ``--verify-fsdp`` results)."""
    L, w = plan.layout, plan.worst
    pb = DTYPE_BYTES[plan.param_dtype]
    lines = [f"lockstep plan: {plan.family} {plan.flavor} on {L.world} ranks"]
    active = f", {_fmt_count(plan.active_params)} active per token" if plan.active_params else ""
    lines.append(f"  model    {_fmt_count(plan.total_params)} params{active}; "
                 f"{fmt_bytes(plan.total_params * pb)} in {plan.param_dtype}")
    lines.append(f"  layout   {L.describe()}")
    local = plan.batch_size // L.dp
    tokens = plan.batch_size * plan.seq_len
    lines.append(f"  batch    {plan.batch_size} seqs x {plan.seq_len} = {tokens:,} tokens/step; "
                 f"{local} seqs per dp rank = {plan.microbatches} micro-batch(es) of {plan.microbatch_size}"
                 + (f" ({plan.pp_schedule})" if L.pp > 1 else ""))
    master = " + fp32 master" if plan.optimizer_bytes_per_param == 12 else ""
    lines.append(f"  dtypes   params {plan.param_dtype}, grads {plan.grad_dtype}, compute {plan.compute_dtype}; "
                 f"AdamW 2 x fp32{master} = {plan.optimizer_bytes_per_param} B/param; "
                 f"activation checkpointing: {plan.activation_checkpoint.describe()}")
    k = ", ".join(f"{name} k={v}" for name, v in plan.activation_k.items())
    lines.append(f"  act.     per block ~ seq x mb x dim x k bytes / tp ({k}); x micro-batches in flight")
    lines.append("")
    lines.append("per-rank memory by pipeline stage (dp/ep/tp index 0, the largest shard):")
    head = f"  {'stage':>5} {'layers':>11} {'params':>11} {'grads':>11} {'optim':>11} {'buffers':>10} " \
           f"{'activations':>12} {'fsdp peak':>11} {'total':>11}"
    lines.append(head)
    for s in plan.stages:
        layers = ",".join(f"{r.start}-{r.stop - 1}" for r in s.layers)
        mark = " <- worst" if s is w and len(plan.stages) > 1 else ""
        lines.append(f"  {s.stage:>5} {layers:>11} {fmt_bytes(s.param_bytes):>11} {fmt_bytes(s.grad_bytes):>11} "
                     f"{fmt_bytes(s.optimizer_bytes):>11} {fmt_bytes(s.buffer_bytes):>10} "
                     f"{fmt_bytes(s.activation_bytes):>12} {fmt_bytes(s.fsdp_transient_bytes):>11} "
                     f"{fmt_bytes(s.total_bytes):>11}{mark}")
    lines.append(f"  worst stage {w.stage}: {_fmt_count(w.param_numel)} parameter elements per rank "
                 f"({w.in_flight_microbatches} micro-batch(es) of activations in flight)")
    lines.append("")
    lines.append(f"collectives per optimizer step on a rank of stage {w.stage}:")
    lines.append(f"  {'op':<15} {'group':<16} {'size/call':>11} {'calls':>7} {'traffic/step':>13}  what")
    for c in w.collectives:
        group = f"{c.group}({c.group_size})"
        lines.append(f"  {c.op:<15} {group:<16} {fmt_bytes(c.bytes_per_call):>11} {c.calls_per_step:>7} "
                     f"{fmt_bytes(c.traffic_per_step):>13}  {c.what}")
    lines.append(f"  total traffic per rank per step ~ {fmt_bytes(w.traffic_per_step)} (ring estimates; "
                 "plus a scalar all-reduce for grad-norm clipping)")
    for note in plan.notes:
        lines.append(f"  note: {note}")
    if plan.verify is not None:
        lines.append("")
        lines.extend(_format_verify(plan.verify))
    return "\n".join(lines)


def _format_verify(v: dict[str, Any]) -> list[str]:
    if not v.get("ok") and "error" in v:
        return [f"verify-fsdp: FAILED to build: {v['error']}"]
    lines = [f"verify-fsdp: stage {v['stage']} built under a fake process group (rank {v['rank']} of "
             f"{v['world']}, mesh {v['mesh']}, via {v['path']}) in {v['seconds']:.1f}s"]
    if v.get("lockstep_path_skipped_reason"):
        lines.append(f"  (not lockstep's own parallelize path: {v['lockstep_path_skipped_reason']})")
    skipped = "" if v["tp_applied"] or not v["tp_skipped_reason"] else f"; TP not applied: {v['tp_skipped_reason']}"
    lines.append(f"  {v['n_params']} parameters, {v['n_match']} local shard shapes match the plan{skipped}")
    lines.append(f"  local elements on this rank: {v['local_numel']:,} (plan: {v['plan_numel']:,})")
    for e in v["examples"]:
        lines.append(f"  {e['name']:<44} {str(tuple(e['shape'])):>20} -> local {str(tuple(e['local_shape'])):>18} "
                     f"{e['placements']} on {e['mesh']}")
    if v.get("hint"):
        lines.append(f"  hint: {v['hint']}")
    for m in v["mismatches"][:10]:
        lines.append(f"  MISMATCH {m['name']}: local {tuple(m['local_shape'])}, plan {tuple(m['plan_shape'])}")
    return lines
