"""Resharding weight sync (lockstep.rl.reshard): the plan from shapes + placements, and bit-exact transfers
between unlike layouts (trainer FSDP 2 / TP 2 -> generator TP 2 / TP 1, and TP 2 -> TP 2) over gloo."""

from __future__ import annotations

import pytest
import torch

from lockstep.rl.reshard import ReshardPlan, TensorLayout


def _layout(shape, mesh_ranks, mesh_shape, placements, dtype="float32"):
    return TensorLayout(tuple(shape), dtype, tuple(mesh_shape), tuple(mesh_ranks), tuple(placements))


def test_boxes_follow_torch_chunking_uneven_and_nested():
    # 5 rows over 2: ceil -> [0, 3) and [3, 5); 2 rows over 4: two ranks hold nothing
    t = _layout((5, 4), [0, 1], (2,), [("S", 0)])
    assert t.box(0) == ((0, 3), (0, 4)) and t.box(1) == ((3, 5), (0, 4)) and t.box(7) is None
    t = _layout((2,), [0, 1, 2, 3], (4,), [("S", 0)])
    assert [t.box(r) for r in range(4)] == [((0, 1),), ((1, 2),), None, None]
    # a 2 x 2 mesh sharding dim 0 twice (left to right) and replicated on dim 1 of the mesh
    t = _layout((8, 3), [0, 1, 2, 3], (2, 2), [("S", 0), ("S", 0)])
    assert [t.box(r)[0] for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    t = _layout((8, 3), [0, 1, 2, 3], (2, 2), [("R",), ("S", 1)])
    assert [t.box(r)[1] for r in range(4)] == [(0, 2), (2, 3), (0, 2), (2, 3)]


def test_plan_tiles_every_destination_once_and_spreads_replicas():
    src = {"w": _layout((6, 4), [0, 1], (2,), [("S", 0)]), "n": _layout((4,), [0, 1], (2,), [("R",)])}
    dst = {"w": _layout((6, 4), [2, 3], (2,), [("S", 1)]), "n": _layout((4,), [2, 3], (2,), [("R",)])}
    plan = ReshardPlan(src, dst)
    for rank in (2, 3):
        got = torch.zeros(6, 2, dtype=torch.int64)
        for piece in (p for p in plan.pieces if p.dst == rank and p.name == "w"):
            (a0, a1), (b0, b1) = piece.dst_slices
            got[a0:a1, b0:b1] += 1
        assert torch.equal(got, torch.ones(6, 2, dtype=torch.int64))  # each element received exactly once
    # the replicated norm: destination 2 reads it from rank 0, destination 3 from rank 1
    assert sorted((p.src, p.dst) for p in plan.pieces if p.name == "n") == [(0, 2), (1, 3)]
    full = 6 * 4 * 4 + 4 * 4
    # w once, the norm once per destination rank (both hold it whole)
    assert plan.full_bytes == full and plan.bytes_sent(0) + plan.bytes_sent(1) == full + 4 * 4
    assert plan.bytes_sent(0) < full and plan.bytes_sent(1) < full


def test_plan_refuses_mismatched_states_and_shared_ranks():
    a = {"w": _layout((4, 4), [0], (1,), [("R",)])}
    with pytest.raises(ValueError, match=r"w is float32\[4, 4\] on the trainer but bfloat16\[4, 4\]"):
        ReshardPlan(a, {"w": _layout((4, 4), [1], (1,), [("R",)], dtype="bfloat16")})
    with pytest.raises(ValueError, match="only the generator's"):
        ReshardPlan(a, {"v": _layout((4, 4), [1], (1,), [("R",)])})
    with pytest.raises(ValueError, match="ranks \\[0\\] hold w on both sides"):
        ReshardPlan(a, {"w": _layout((4, 4), [0], (1,), [("R",)])})


# --- transfers between processes: one spawn of 4 gloo ranks runs every layout pair

#: (name, trainer layout on ranks 0-1, generator layout, generator ranks, model family)
CASES = [("fsdp2->tp2", "fsdp", "tp", [2, 3], "llama3"), ("tp2->tp1", "tp", "whole", [2], "llama3"),
         ("fsdp2->tp1", "fsdp", "whole", [3], "llama3"), ("tp2->tp2", "tp", "tp", [2, 3], "llama3"),
         ("fsdp2->ep2", "fsdp", "ep", [2, 3], "qwen3_moe")]


def _model(family, seed):
    from lockstep.models.common.transformer import build_model
    from lockstep.models.registry import model_config

    return build_model(model_config(family, "debug"), seed=seed)


def _shard(model, kind, mesh):
    from torch.distributed.fsdp import fully_shard

    from lockstep.generate.parallel import shard_for_generation
    from lockstep.parallel.parallelize import apply_dense_tp

    if kind == "tp":
        apply_dense_tp(model, mesh)
    elif kind == "ep":  # the generation engine's expert-parallel layout: each rank half of the routed experts
        shard_for_generation(model, ep=mesh.size(), group=mesh.get_group())
    elif kind == "fsdp":
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def _load(model, full_state):
    """Set each local shard from the full tensors (DTensor's own slicing, no communication)."""
    from torch.distributed.tensor import distribute_tensor

    from lockstep.rl.reshard import unique_state

    for name, tensor in unique_state(model):
        full = full_state[name]
        if hasattr(tensor, "device_mesh"):
            tensor._local_tensor.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                                         src_data_rank=None).to_local())
        else:
            tensor.copy_(full)


def _mismatches(model, full_state, boxes=None) -> list[str]:
    """Names whose local tensor is not the part of the full tensor this rank should hold: a DTensor's as
    ``distribute_tensor`` places it, or, given ``boxes`` (name -> this rank's box from
    :func:`lockstep.rl.reshard.describe`; None: it holds nothing) that slice (the FSDP-over-TP trainer's
    strided shards, as the resharding plan reads them)."""
    from torch.distributed.tensor import distribute_tensor

    from lockstep.rl.reshard import local_tensor, unique_state

    bad = []
    for name, tensor in unique_state(model):
        want = full_state[name]
        if boxes is not None:
            box = boxes[name]
            want = want[tuple(slice(a, b) for a, b in box)] if box is not None else None
        elif hasattr(tensor, "device_mesh"):
            want = distribute_tensor(want, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        if want is None or not torch.equal(local_tensor(tensor), want):
            bad.append(name)
    return bad


def _worker(rank, world, init_file, out_dir):
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from lockstep.rl.reshard import ReshardPlan, describe, exchange_layouts, side_layout, unique_state
    from lockstep.rl.reshard_transfer import ReshardReceiver, ReshardSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    meshes = {(0, 1): DeviceMesh("cpu", torch.tensor([0, 1])), (2, 3): DeviceMesh("cpu", torch.tensor([2, 3]))}
    results = {}
    for name, src_kind, dst_kind, dst_ranks, family in CASES:
        versions = {v: _model(family, seed=10 + v).state_dict() for v in (1, 2)}  # the trainer's at each version
        mine = None
        if rank in (0, 1):
            model = _shard(_model(family, seed=0), src_kind, meshes[(0, 1)])
            mine = describe(model, [0, 1])
        elif rank in dst_ranks:
            model = _shard(_model(family, seed=1), dst_kind, meshes.get(tuple(dst_ranks)))
            mine = describe(model, dst_ranks)
        described = exchange_layouts(mine)
        plan = ReshardPlan(side_layout(described, [0, 1], list(range(world))),
                           side_layout(described, dst_ranks, list(range(world))))
        model_bytes = sum(t.numel() * t.element_size() for _, t in unique_state(_model(family, seed=0)))
        out = {"full_bytes": plan.full_bytes, "model_bytes": model_bytes,
               "bytes_sent": {r: plan.bytes_sent(r) for r in (0, 1)},
               "received_bytes": sum(p.nbytes for p in plan.pieces)}
        if rank in (0, 1):
            sender = ReshardSender(model, plan, rank)
            for version, state in versions.items():
                _load(model, state)
                out[f"metrics{version}"] = sender.send(version)
            sender.close()
        elif rank in dst_ranks:
            receiver = ReshardReceiver(model, plan, rank, first=1, last=2)
            for version, state in versions.items():
                receiver.apply_until(version)
                out[f"mismatches{version}"] = _mismatches(model, state)
                out[f"version{version}"] = receiver.version
        results[name] = out
        dist.barrier()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_reshard_between_unlike_layouts_is_bitwise(computed_once):
    """Two successive versions on every generator rank equal the trainer's full weights (torch.equal of
    every local shard vs the same slice of the full tensor); each trainer rank sends less than the model.
    Pairs: FSDP 2 -> TP 2 / TP 1 / EP 2 (qwen3_moe: routed experts Shard(0) over the generator ranks),
    TP 2 -> TP 1 / TP 2."""
    import torch.multiprocessing as mp

    def run(d):
        mp.spawn(_worker, args=(4, str(d / "init"), str(d)), nprocs=4, join=True)

    tmp = computed_once("reshard spawn world 4", run)
    res = {rank: torch.load(tmp / f"rank{rank}.pt") for rank in range(4)}
    for name, _, dst_kind, dst_ranks, _ in CASES:
        for rank in dst_ranks:
            out = res[rank][name]
            assert out["version1"] == 1 and out["version2"] == 2, name
            assert out["mismatches1"] == [] and out["mismatches2"] == [], (name, rank, out)
        out = res[0][name]
        full = out["full_bytes"]
        assert full == out["model_bytes"] > 0  # the whole model once (fp32; a tied embedding once)
        for rank in (0, 1):
            sent = res[rank][name]["bytes_sent"][rank]
            assert 0 < sent < full, (name, rank, sent)
            assert res[rank][name]["metrics2"]["weight_sync/bytes"] == sent
        # what the trainer ranks send together is exactly what the generator ranks hold
        assert out["bytes_sent"][0] + out["bytes_sent"][1] == out["received_bytes"]
        if dst_kind == "whole":
            assert out["received_bytes"] == full
