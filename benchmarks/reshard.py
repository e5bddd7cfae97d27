"""Resharding weight sync vs gather-and-broadcast (issue #23): bytes per trainer rank and time per version.

Part 1 (shapes only, no processes): llama3 8B in bf16, trainer FSDP over T ranks -> a TP generator
group; the most bytes one trainer rank sends per version with the resharding plan vs with gather
(trainer rank 0 sends the whole model to each generator rank; its gather receives (T-1)/T of it too).

Part 2 (measured, gloo, 4 processes on this host): llama3 ``--flavor`` fp32, trainer FSDP 2 (ranks 0-1) ->
generator TP 2 (ranks 2-3); per version, from a barrier until every generator rank holds the new
weights, interleaved rounds of:

- ``reshard``: every trainer rank sends each generator rank its pieces (lockstep.rl.reshard);
- ``gather``: the full state gathered on trainer rank 0 (DCP ``get_model_state_dict(full_state_dict)``, as
  the RL trainer's copy is refreshed), packed into one flat buffer (``FlatState``) and broadcast to each
  generator rank over its own two-rank group, each generator rank then copying its slices out.

Prints wall seconds per version (median of rounds) and the ratio gather / reshard, plus the trainer
ranks' process CPU seconds (the host is shared: wall time moves with its load, CPU time less so).

    .venv/bin/python benchmarks/reshard.py --flavor small --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def plan_sizes() -> None:
    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.registry import model_config
    from lockstep.rl.reshard import ReshardPlan, TensorLayout

    shapes = {k: tuple(v.shape) for k, v in build_meta_model(model_config("llama3", "8B")).state_dict().items()}

    def tp(name: str, shape: tuple) -> tuple:
        if len(shape) == 1:
            return ("R",)
        if any(s in name for s in ("wo", "w2")):
            return ("S", 1)
        return ("S", 0)  # wq/wk/wv, w1/w3, vocabulary rows of the embedding and head

    print("part 1: llama3 8B bf16, bytes per version (plan only)")
    for fsdp, degree in ((8, 2), (8, 8), (64, 8)):
        src = {k: TensorLayout(s, "bfloat16", (fsdp,), tuple(range(fsdp)), (("S", 0),)) for k, s in shapes.items()}
        dst = {k: TensorLayout(s, "bfloat16", (degree,), tuple(range(fsdp, fsdp + degree)), (tp(k, s),))
               for k, s in shapes.items()}
        started = time.process_time()
        plan = ReshardPlan(src, dst)
        seconds = time.process_time() - started
        most = max(plan.bytes_sent(r) for r in range(fsdp))
        gather = plan.full_bytes * degree  # rank 0 sends the whole model to each generator rank
        print(f"  FSDP {fsdp:3d} -> TP {degree}: model {plan.full_bytes / 2**30:.2f} GiB; most per trainer rank: "
              f"reshard {most / 2**30:.3f} GiB, gather {gather / 2**30:.2f} GiB (ratio gather/reshard "
              f"{gather / most:.0f}x); {len(plan.pieces)} pieces, plan {seconds:.2f} s CPU")


def _worker(rank: int, world: int, init: str, flavor: str, rounds: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from lockstep.models.common.transformer import build_model
    from lockstep.models.registry import model_config
    from lockstep.parallel.parallelize import apply_dense_tp
    from lockstep.rl.reshard import ReshardPlan, describe, exchange_layouts, side_layout, unique_state
    from lockstep.rl.reshard_transfer import ReshardReceiver, ReshardSender
    from lockstep.rl.transport import FlatState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    trainer_mesh, gen_mesh = DeviceMesh("cpu", torch.tensor([0, 1])), DeviceMesh("cpu", torch.tensor([2, 3]))
    pairs = {g: dist.new_group([0, g]) for g in (2, 3)}
    model = build_model(model_config("llama3", flavor), seed=0)
    if rank < 2:
        for block in model.layers.values():
            fully_shard(block, mesh=trainer_mesh)
        fully_shard(model, mesh=trainer_mesh)
        mine = describe(model, [0, 1])
    else:
        full_copy = build_model(model_config("llama3", flavor), seed=0)  # where gather's bytes land
        apply_dense_tp(model, gen_mesh)
        mine = describe(model, [2, 3])
    described = exchange_layouts(mine)
    plan = ReshardPlan(side_layout(described, [0, 1], list(range(4))), side_layout(described, [2, 3], list(range(4))))
    n = 2 * rounds
    sender = ReshardSender(model, plan, rank) if rank < 2 else None
    receiver = ReshardReceiver(model, plan, rank, first=1, last=rounds) if rank >= 2 else None
    # gather's flat buffer: rank 0 packs the gathered state into it, generator ranks unpack it into a full copy
    flat = FlatState(full_copy) if rank >= 2 else FlatState(build_model(model_config("llama3", flavor), seed=0)) \
        if rank == 0 else None
    buffer = flat.new_buffer() if flat is not None else None
    times: dict[str, list[float]] = {"reshard": [], "gather": []}
    cpu: dict[str, list[float]] = {"reshard": [], "gather": []}
    version = 0
    for i in range(n):
        kind = "reshard" if i % 2 == 0 else "gather"
        dist.barrier()
        wall, proc = time.perf_counter(), time.process_time()
        if kind == "reshard":
            version += 1
            if sender is not None:
                sender.send(version)
                sender.wait()
            else:
                receiver.apply_until(version)
        else:
            if rank < 2:
                state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    for name, _, view in flat._views(buffer):
                        view.copy_(state[name])
                    works = [dist.broadcast(buffer, src=0, group=pairs[g], async_op=True) for g in (2, 3)]
                    for w in works:
                        w.wait()
            else:
                dist.broadcast(buffer, src=0, group=pairs[rank])
                flat.unpack(buffer)
                whole = dict(unique_state(full_copy))
                with torch.no_grad():
                    for name, tensor in unique_state(model):
                        full = whole[name].detach()
                        if hasattr(tensor, "device_mesh"):
                            tensor._local_tensor.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                                                         src_data_rank=None).to_local())
                        else:
                            tensor.detach().copy_(full)
        dist.barrier()
        times[kind].append(time.perf_counter() - wall)
        cpu[kind].append(time.process_time() - proc)
    torch.save({"times": times, "cpu": cpu, "sent": plan.bytes_sent(rank) if rank < 2 else 0,
                "full": plan.full_bytes}, f"{out}/rank{rank}.pt")
    if sender is not None:
        sender.close()
    dist.destroy_process_group()
    os._exit(0)


def measure(flavor: str, rounds: int) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(4, f"{tmp}/init", flavor, rounds, tmp), nprocs=4, join=True)
        res = [torch.load(f"{tmp}/rank{r}.pt") for r in range(4)]
    wall = {k: statistics.median(res[0]["times"][k]) for k in ("reshard", "gather")}
    cpu = {k: statistics.median(sum(res[r]["cpu"][k][i] for r in (0, 1)) for i in range(rounds))
           for k in ("reshard", "gather")}
    full = res[0]["full"]
    print(f"part 2: llama3 {flavor} fp32 ({full / 2**20:.1f} MiB), FSDP 2 -> TP 2, gloo, {rounds} interleaved rounds")
    print(f"  bytes sent per version: reshard rank0 {res[0]['sent'] / 2**20:.1f} MiB, rank1 "
          f"{res[1]['sent'] / 2**20:.1f} MiB; gather: rank 0 {2 * full / 2**20:.1f} MiB (whole model to each "
          f"generator rank) after the gather")
    print(f"  wall s/version (median): reshard {wall['reshard']:.4f}, gather {wall['gather']:.4f}, "
          f"ratio gather/reshard {wall['gather'] / wall['reshard']:.2f}")
    print(f"  trainer ranks' CPU s/version (median, both ranks): reshard {cpu['reshard']:.4f}, gather "
          f"{cpu['gather']:.4f}, ratio {cpu['gather'] / cpu['reshard']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="small", help="llama3 flavor of part 2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    plan_sizes()
    measure(args.flavor, args.rounds)


if __name__ == "__main__":
    main()
