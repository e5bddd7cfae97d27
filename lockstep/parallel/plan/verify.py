"""``lockstep plan --verify-fsdp``: check a plan's shard shapes against a real sharded build.

It builds the worst stage for real under a fake process group (``init_process_group("fake")``,
``init_device_mesh("cpu", ...)``) on the meta device, applies ``fully_shard`` (and lockstep's TP plan
where lockstep has one, and EP by ``distribute_tensor`` of the routed experts), and compares every
parameter's local DTensor shard shape with the plan. Where lockstep's own ``ParallelConfig``
accepts the layout (pp = 1; TP only on dense blocks; EP as far as lockstep supports it) it goes
through lockstep's path (``ParallelDims.build_mesh`` + ``parallelize_dense``) instead, so the check
covers the code the trainer runs.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.models.common.attention import GroupedQueryAttention as GQA
from lockstep.models.common.mlp import SwiGLU
from lockstep.models.common.moe import GroupedExperts
from lockstep.parallel.pipeline import layer_ranges
from lockstep.parallel.plan.build import Plan, build_meta_model
from lockstep.parallel.plan.layout import flag_error

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
        native, native_reason = _lockstep_parallel_config(plan, model)
        if native is not None:
            mesh_desc, tp_applied, reason = _shard_lockstep(model, plan, *native)
            path = "lockstep ParallelDims.build_mesh + parallelize_dense"
        else:
            mesh_desc, tp_applied, reason = _shard_mesh(model, plan, stage)
            path = "torchtitan-style mesh (pp, dp_replicate, dp_shard_mod_ep, ep, tp) + fully_shard"
        result = _compare(model, plan, stage, rank, tp_applied)
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


def _is_dense(model: nn.Module) -> bool:
    return all(isinstance(b.attention, GQA) and isinstance(b.feed_forward, SwiGLU) for b in model.layers.values())


def _lockstep_parallel_config(plan: Plan, model: nn.Module) -> tuple[tuple[Any, Any] | None, str]:
    """(ParallelConfig, ParallelDims) when lockstep's own parallelize path covers the layout, else
    (None, why not)."""
    from lockstep.parallel.dims import ParallelConfig

    L = plan.layout
    if L.pp > 1:
        return None, "pp > 1: lockstep's ParallelConfig has no pipeline degree"
    if L.tp > 1 and not _is_dense(model):
        return None, "tp > 1 on MLA/MoE blocks: lockstep's TP plan covers GQA + SwiGLU only"
    kwargs: dict[str, Any] = dict(dp_replicate=L.dp_replicate, dp_shard=L.dp_shard, tp=L.tp,
                                  fsdp_param_dtype="bfloat16" if plan.compute_dtype == "bf16" else "float32",
                                  reshard_after_forward=plan.reshard_after_forward)
    if L.ep > 1:
        if "ep" not in {f.name for f in dataclasses.fields(ParallelConfig)}:
            return None, "ep > 1: lockstep's ParallelConfig has no expert-parallel degree"
        kwargs["ep"] = L.ep
    pcfg = ParallelConfig(**kwargs)
    try:
        dims = pcfg.resolve(L.world)
    except ConfigError as err:
        return None, f"lockstep refuses the layout: {err}"
    return (pcfg, dims), ""


def _shard_lockstep(model: nn.Module, plan: Plan, pcfg, dims) -> tuple[str, bool, str]:
    from lockstep.parallel.parallelize import parallelize_dense

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened dim from the root mesh
        mesh = dims.build_mesh("cpu")
        if mesh is not None:
            parallelize_dense(model, dims, mesh, pcfg)
    desc = str(dict(dims.mesh_dims)) if dims.mesh_dims else "{} (world 1)"
    return desc, plan.layout.tp > 1, ""


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
        if _is_dense(model):
            apply_dense_tp(model, mesh["tp"])
            tp_applied = True
        else:
            reason = "lockstep has no TP plan for MLA/MoE blocks (shapes compared without the TP split)"
    # cut to the stage, as lockstep.parallel.pipeline does
    keys = list(model.layers.keys())
    keep = {keys[i] for i in layer_ranges(len(keys), L.pp)[stage]}
    for k in keys:
        if k not in keep:
            del model.layers[k]
    if stage != 0:
        model.tok_embeddings = None
    if stage != L.pp - 1:
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


def _compare(model: nn.Module, plan: Plan, stage: int, rank: int, tp_applied: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    c = plan.layout.coords(rank)
    by_name = {p.name: p for p in plan.stages[stage].params}
    n, match, local_numel, plan_numel = 0, 0, 0, 0
    mismatches, examples, seen_kinds = [], [], set()
    for name, p in model.named_parameters():
        placed = by_name.get(name)
        if placed is None:
            mismatches.append({"name": name, "local_shape": list(p.shape), "plan_shape": None})
            continue
        n += 1
        local = p.to_local() if isinstance(p, DTensor) else p
        idx = c["dp_shard_mod_ep"] if placed.ep > 1 else c["dp_shard"]
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
    missing = sorted(set(by_name) - {nm for nm, _ in model.named_parameters()})
    for name in missing:
        mismatches.append({"name": name, "local_shape": None, "plan_shape": list(by_name[name].local_shape(0))})
    return {"n_params": n, "n_match": match, "mismatches": mismatches, "examples": examples,
            "local_numel": local_numel, "plan_numel": plan_numel}
