"""``lockstep plan --verify-fsdp``: check a plan's shard shapes against a real sharded build.

It builds the worst pipeline rank for real under a fake process group (``init_process_group("fake")``)
on the meta device and compares every parameter's local DTensor shard shape with the plan. Where
lockstep's own :class:`ParallelConfig` accepts the layout it runs the trainer's code: the mesh of
``ParallelDims.build_mesh``; without PP ``parallelize_dense`` on the whole model; with PP the
stages this rank holds cut by ``split_into_stages`` (the runner's split and placement) and each
sharded by ``stage_parallelizer`` -- EP, the TP plan of every block kind (GQA/MLA, SwiGLU/MoE,
MTP), FSDP with expert units. A layout lockstep refuses (the refusal is reported) is checked on a
torchtitan-style mesh (pp, dp_replicate, dp_shard_mod_ep, ep, tp) with lockstep's TP plan,
``distribute_tensor`` of the routed experts and ``fully_shard``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import GroupedExperts
from lockstep.parallel.plan.build import Plan, _fsdp_index, build_meta_model
from lockstep.parallel.plan.layout import flag_error, stage_layout

if TYPE_CHECKING:
    from lockstep.models.common.transformer import TransformerConfig


def verify_fsdp(plan: Plan, config: TransformerConfig, stage: int | None = None) -> dict[str, Any]:
    """Build ``stage`` (default: the worst) of ``config`` on the meta device under a fake process
    group of ``plan.layout.world`` ranks, shard it, and compare local shard shapes with the plan."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    L = plan.layout
    stage = plan.worst.stage if stage is None else stage
    if not 0 <= stage < L.pp:
        flag_error("--verify-stage", f"must be in [0, pp={L.pp}), got {stage}")
    if dist.is_initialized():
        raise RuntimeError("--verify-fsdp: a process group is already initialised here; run it in a fresh process")
    rank = L.first_rank_of_stage(stage)
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=L.world)
    try:
        model = build_meta_model(config)
        native, native_reason = _lockstep_parallel_config(plan)
        if native is not None:
            mesh_desc, parts = _shard_lockstep(model, plan, stage, *native)
            path = ("lockstep ParallelDims.build_mesh + " + ("split_into_stages + stage_parallelizer"
                                                           if L.pp > 1 else "parallelize_dense"))
            tp_applied, reason = L.tp > 1, ""
        else:
            mesh_desc, tp_applied, reason = _shard_mesh(model, plan, stage)
            parts = [model]
            path = "torchtitan-style mesh (pp, dp_replicate, dp_shard_mod_ep, ep, tp) + fully_shard"
        named = [(n, p) for part in parts for n, p in part.named_parameters()]
        result = _compare(named, plan, stage, rank, tp_applied)
        if native is not None and result["mismatches"] and L.dp_shard == 1 and L.dp_replicate > 1:
            result["hint"] = ("lockstep's fsdp.dp_mesh takes the lone dp_replicate dim as the FSDP mesh, so "
                              "fully_shard shards over the replicas instead of replicating; the plan assumes "
                              "replicas hold full copies")
        result.update(ok=not result["mismatches"], stage=stage, rank=rank, world=L.world, mesh=mesh_desc,
                      path=path, lockstep_path_skipped_reason=native_reason, tp_applied=tp_applied,
                      tp_skipped_reason=reason,
                      seconds=time.perf_counter() - t0)
        return result
    finally:
        dist.destroy_process_group()


def _lockstep_parallel_config(plan: Plan) -> tuple[tuple[Any, Any] | None, str]:
    """(ParallelConfig, ParallelDims) when lockstep's own parallelize path accepts the layout, else
    (None, lockstep's refusal)."""
    from lockstep.parallel.dims import ParallelConfig

    L = plan.layout
    pcfg = ParallelConfig(dp_replicate=L.dp_replicate, dp_shard=L.dp_shard, tp=L.tp, ep=L.ep, cp=L.cp, pp=L.pp,
                          pp_schedule=plan.pp_schedule, cp_method=plan.cp_method,
                          fsdp_param_dtype="bfloat16" if plan.compute_dtype == "bf16" else "float32",
                          reshard_after_forward=plan.reshard_after_forward)
    try:
        pcfg.validate()
        dims = pcfg.resolve(L.world)
    except ConfigError as err:
        return None, f"lockstep refuses the layout: {err}"
    return (pcfg, dims), ""


def _shard_lockstep(model: nn.Module, plan: Plan, stage: int, pcfg, dims) -> tuple[str, list[nn.Module]]:
    """Shard pipeline rank ``stage``'s part(s) of ``model`` as the trainer does; (mesh, parts)."""
    from lockstep.parallel.parallelize import parallelize_dense

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened dim from the root mesh; plan keys a stage lacks
        mesh = dims.build_mesh("cpu")
        if plan.layout.pp == 1:
            if mesh is not None:
                parallelize_dense(model, dims, mesh, pcfg)
            parts = [model]
        else:
            from lockstep.parallel.pipeline_parallelize import stage_parallelizer
            from lockstep.parallel.pipeline_stage import split_into_stages

            ranges, rank_stages = stage_layout(model, plan.layout, plan.pp_schedule, plan.pp_split, plan.seq_len)
            parts = split_into_stages(model, len(ranges), rank_stages[stage], [len(r) for r in ranges])
            shard = stage_parallelizer(dims, mesh, pcfg)
            parts = [shard(part) for part in parts]
    desc = str(dict(dims.mesh_dims)) if dims.mesh_dims else "{} (world 1)"
    return desc, parts


def _shard_mesh(model: nn.Module, plan: Plan, stage: int) -> tuple[str, bool, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from lockstep.parallel.parallelize import apply_dense_tp

    L = plan.layout
    names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    mesh = init_device_mesh("cpu", (L.pp, L.dp_replicate, L.expert_fsdp, L.ep, L.tp), mesh_dim_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened dim from the root mesh
        mesh[("dp_shard_mod_ep", "ep")]._flatten("dp_shard")
        dp_mesh = mesh[("dp_replicate", "dp_shard")] if L.dp_replicate > 1 else mesh["dp_shard"]
        ep_fsdp_mesh = (mesh[("dp_replicate", "dp_shard_mod_ep")] if L.dp_replicate > 1
                        else mesh["dp_shard_mod_ep"])
    tp_applied, reason = False, ""
    if L.tp > 1:
        try:
            apply_dense_tp(model, mesh["tp"])
            tp_applied = True
        except ConfigError as err:
            reason = f"lockstep has no TP plan for this block kind ({err}); shapes compared without the TP split"
    # cut to the stage, as lockstep.parallel.pipeline does
    keys = list(model.layers.keys())
    ranges, rank_stages = stage_layout(model, L, plan.pp_schedule, plan.pp_split, plan.seq_len)
    keep = {keys[i] for vs in rank_stages[stage] for i in ranges[vs]}
    last = len(ranges) - 1 in rank_stages[stage]
    for k in keys:
        if k not in keep:
            del model.layers[k]
    if stage != 0 and not (last and (getattr(model, "mtp", None) is not None or model.config.tie_embeddings)):
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
        if getattr(model, "mtp", None) is not None:
            model.mtp = None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if plan.compute_dtype == "bf16" else torch.float32,
                                  reduce_dtype=torch.float32)
    blocks = list(model.layers.values()) + (list(model.mtp.values()) if getattr(model, "mtp", None) else [])
    for block in blocks:
        for mod in block.modules():
            if isinstance(mod, GroupedExperts) and L.ep > 1:
                for w in ("w1", "w2", "w3"):
                    p = getattr(mod, w)
                    setattr(mod, w, nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
                n_local = mod.n_experts // L.ep
                dim = 0 if n_local >= L.expert_fsdp else 1
                fully_shard(mod, mesh=ep_fsdp_mesh, mp_policy=policy,
                            shard_placement_fn=lambda _p, d=dim: Shard(d))
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    desc = "{" + ", ".join(f"{n}: {s}" for n, s in zip(names, mesh.shape)) + "}"
    return desc, tp_applied, reason


def _compare(named: Iterable[tuple[str, nn.Parameter]], plan: Plan, stage: int, rank: int,
             tp_applied: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    c = plan.layout.coords(rank)
    by_name = {p.name: p for p in plan.stages[stage].params}
    n, match, local_numel, plan_numel = 0, 0, 0, 0
    mismatches, examples, seen_kinds = [], [], set()
    named = list(named)
    for name, p in named:
        placed = by_name.get(name)
        if placed is None:
            mismatches.append({"name": name, "local_shape": list(p.shape), "plan_shape": None})
            continue
        n += 1
        local = p.to_local() if isinstance(p, DTensor) else p
        idx = _fsdp_index(placed, c, plan.layout)
        want = placed.local_shape(idx, apply_tp=tp_applied or placed.tp_dim is None)
        local_numel += local.numel()
        plan_numel += math.prod(want)
        if tuple(local.shape) == want:
            match += 1
        else:
            mismatches.append({"name": name, "local_shape": list(local.shape), "plan_shape": list(want)})
        if placed.kind not in seen_kinds:
            seen_kinds.add(placed.kind)
            examples.append({"name": name, "shape": list(p.shape), "local_shape": list(local.shape),
                             "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else [],
                             "mesh": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else []})
    missing = sorted(set(by_name) - {nm for nm, _ in named})
    for name in missing:
        mismatches.append({"name": name, "local_shape": None, "plan_shape": list(by_name[name].local_shape(0))})
    return {"n_params": n, "n_match": match, "mismatches": mismatches, "examples": examples,
            "local_numel": local_numel, "plan_numel": plan_numel}
