"""FlexShard (issue #20): distributed Muon vs the gather-everything baseline, FP8 vs BF16 all-gather.

Each rank (gloo, one process and one thread per rank, world 2 and 4) trains a llama3 (``--dim``,
``--layers``; head_dim 64, every rank its own ``--batch`` x ``--seq`` tokens) under FlexShard
(``parallel.sharding=flex``). Measured apart, as the update's hierarchy asks:

1. **Optimizer stage** (``opt.step()`` alone, after a barrier; the slowest rank's time per step, wall
   and the process's CPU time -- on a host shared with other jobs the CPU time counts only this
   rank's own work, the wall time also the time it was descheduled):
   Muon with q/k/v per head (``optimizer.muon_per_head``) in both rows, over
   - ``baseline``: every parameter ``shard(0)`` -- each Muon matrix is all-gathered (momentum-
     corrected), orthogonalised whole on every rank, and the rank keeps its rows (what FSDP2 row
     shards do, lockstep.train.muon);
   - ``distributed``: the ``muon`` preset -- hidden matrices ``owned`` (owners balanced by
     Newton-Schulz cost), q/k/v ``block_shard(0, head_dim)`` -- each rank orthogonalises what it
     holds, no gather.
   With the bytes and time of the all-gathers issued inside the stage (dist's all-gather wrapped).
2. **Forward all-gather** of the hidden matrices as ``block_shard(0,128)`` buckets, parameters
   gathered in BF16 (``fsdp_param_dtype=bfloat16``) vs blockwise FP8 (``+fp8``: quantise own
   128x128 tiles, gather FP8 bytes + fp32 scales, dequantise): bytes passed to the all-gather per
   rank, and the time of gathering the hidden bucket's groups once (pack/quantise, the collective,
   assemble/dequantise), outside a step; also every group (the embedding, head and norms stay
   ``shard(0)`` in BF16 in both rows) and the bytes gathered inside a step (forward and the
   backward's re-gather).
3. **Whole step** (forward, backward, gradient reduce and clip, optimizer) of each row; the FP8 and
   BF16 rows use AdamW so their optimizer stages are alike.

    .venv/bin/python benchmarks/flex_shard.py [--worlds 2,4] [--dim 512] [--layers 4] [--batch 2]
        [--seq 64] [--steps 3] [--warmup 1] [--json out.json]

Rows run in order inside one spawn per world; medians over ``--steps`` after ``--warmup``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.parallelize import parallelize_dense
from lockstep.train.optim import OptimizerConfig

PER_HEAD = ["layers.*.attention.w[qkv].weight"]
HIDDEN = "layers.*.attention.w[qkvo].weight|layers.*.feed_forward.w[123].weight"
REST = "tok_embeddings.weight|norm.weight|output.weight|layers.*_norm.weight=shard(0)"
ROWS = {
    # name: (ParallelConfig fields, optimizer)
    "baseline": (dict(sharding="flex"), "muon"),
    "distributed": (dict(sharding="flex", flex_preset="muon"), "muon"),
    "bf16_gather": (dict(sharding="flex", fsdp_param_dtype="bfloat16",
                         flex_buckets=[f"{HIDDEN}=block_shard(0,128)", REST]), "adamw"),
    "fp8_gather": (dict(sharding="flex", fsdp_param_dtype="bfloat16",
                        flex_buckets=[f"{HIDDEN}=block_shard(0,128)+fp8", REST]), "adamw"),
}


class _Gathers:
    """Wraps torch.distributed's all-gather functions (FlexShard looks them up at call time): bytes
    each rank passes in, calls, and the time spent inside the calls."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __enter__(self):
        self.sent, self.calls, self.seconds, self._saved = 0, 0, 0.0, {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(out, inp, *args, _fn=fn, **kwargs):
                self.sent += inp.numel() * inp.element_size()
                self.calls += 1
                t0 = time.perf_counter()
                result = _fn(out, inp, *args, **kwargs)
                self.seconds += time.perf_counter() - t0
                return result

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _model_config(args):
    cfg = model_config("llama3", "tiny")
    return dataclasses.replace(cfg, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                               n_kv_heads=max(args.dim // 128, 1), ffn_dim=3 * args.dim, vocab_size=args.vocab,
                               max_seq_len=max(cfg.max_seq_len, args.seq))


def _slowest(seconds: float) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _row(args, name: str, rank: int, world: int) -> dict:
    from lockstep.parallel.runtime import ParallelRuntime
    from lockstep.run.objective import LMObjective

    fields, optimizer = ROWS[name]
    config = ParallelConfig(dp_shard=world, **fields)
    runtime = ParallelRuntime.create(config, device="cpu")
    cfg = _model_config(args)
    model = parallelize_dense(build_model(cfg, seed=0), runtime.dims, runtime.mesh, config, "none")
    runtime.model = model
    opt_cfg = OptimizerConfig(name=optimizer, lr=1e-3, muon_per_head=PER_HEAD if optimizer == "muon" else [])
    opt = opt_cfg.build(model)
    g = torch.Generator().manual_seed(rank)
    rec = {"step": [], "opt": [], "opt_gather_s": [], "opt_gather_bytes": [], "fwd_gather_bytes": [],
           "step_cpu": [], "opt_cpu": []}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with _Gathers() as fwd:
            loss, _ = LMObjective()(model, (tokens[:, :-1], tokens[:, 1:]))
            loss.backward()
            runtime.clip_gradients(1.0)
        dist.barrier()  # the optimizer stage starts together on every rank
        t1, c1 = time.perf_counter(), time.process_time()
        with _Gathers() as inside:
            opt.step()
        t_opt, c_opt = time.perf_counter() - t1, time.process_time() - c1
        opt.zero_grad(set_to_none=True)
        runtime.after_optimizer_step(model)
        t_step, c_step = time.perf_counter() - t0, time.process_time() - c0
        if step >= args.warmup:
            rec["step"].append(_slowest(t_step))
            rec["opt"].append(_slowest(t_opt))
            rec["step_cpu"].append(_slowest(c_step))
            rec["opt_cpu"].append(_slowest(c_opt))
            rec["opt_gather_s"].append(_slowest(inside.seconds))
            rec["opt_gather_bytes"].append(inside.sent)
            rec["fwd_gather_bytes"].append(fwd.sent)
    # the forward all-gathers alone: every group gathered once (as the forward does), outside a step;
    # the hidden matrices' bucket (flex_buckets[0] of the gather rows) apart from the rest
    out = {k: statistics.median(v) for k, v in rec.items()}
    groups = model._flex_shard.groups()
    for part, members in (("all", groups), ("hidden", [g for g in groups if g.layouts[0].bucket.endswith("[0]")])):
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            with _Gathers() as alone, torch.no_grad():
                for group in members:
                    group.wait_wholes()
            times.append(_slowest(time.perf_counter() - t0))
        out[f"gather_{part}_s"] = statistics.median(times)
        out[f"gather_{part}_bytes"] = alone.sent
    dist.destroy_process_group()
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str, args) -> None:
    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["RANK"] = str(rank)
    results = {}
    for name in ROWS:
        dist.init_process_group("gloo", init_method=f"file://{init_file}-{name}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=1800))
        results[name] = _row(args, name, rank, world)
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default="")
    args = p.parse_args()
    cfg = _model_config(args)
    print(f"llama3 dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads (head_dim 64), {cfg.n_kv_heads} kv "
          f"heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}; batch {args.batch} x seq {args.seq} per rank; "
          f"medians of {args.steps} steps after {args.warmup}; gloo, 1 thread per rank")
    everything = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(world, os.path.join(d, "init"), d, args), nprocs=world, join=True)
            with open(os.path.join(d, "results.json")) as f:
                res = json.load(f)
        everything[world] = res
        base, dist_ = res["baseline"], res["distributed"]
        print(f"\nworld {world}: optimizer stage (Muon, q/k/v per head), slowest rank, median s/step")
        print(f"  {'row':<12} {'opt s':>8} {'opt cpu s':>10} {'in-stage gather s':>18} {'in-stage gather MiB':>20} "
              f"{'step s':>8} {'step cpu s':>11}")
        for name in ("baseline", "distributed"):
            r = res[name]
            print(f"  {name:<12} {r['opt']:8.3f} {r['opt_cpu']:10.3f} {r['opt_gather_s']:18.3f} "
                  f"{_mib(r['opt_gather_bytes']):>20} {r['step']:8.3f} {r['step_cpu']:11.3f}")
        print(f"  distributed / baseline optimizer stage: {dist_['opt'] / base['opt']:.2f}x wall, "
              f"{dist_['opt_cpu'] / base['opt_cpu']:.2f}x cpu (target <= 0.5x); whole step "
              f"{dist_['step'] / base['step']:.2f}x wall, {dist_['step_cpu'] / base['step_cpu']:.2f}x cpu")
        bf, f8 = res["bf16_gather"], res["fp8_gather"]
        print(f"world {world}: forward all-gather, hidden matrices block_shard(0,128), AdamW; 'hidden': their "
              f"groups alone, 'all': every group (embedding, head, norms shard(0) in bf16 in both rows)")
        print(f"  {'row':<12} {'hidden s':>9} {'hidden MiB':>11} {'all s':>7} {'all MiB':>8} "
              f"{'in-step gather MiB':>19} {'step s':>8}")
        for name in ("bf16_gather", "fp8_gather"):
            r = res[name]
            print(f"  {name:<12} {r['gather_hidden_s']:9.3f} {_mib(r['gather_hidden_bytes']):>11} "
                  f"{r['gather_all_s']:7.3f} {_mib(r['gather_all_bytes']):>8} {_mib(r['fwd_gather_bytes']):>19} "
                  f"{r['step']:8.3f}")
        print(f"  fp8 / bf16, hidden bucket: bytes {f8['gather_hidden_bytes'] / bf['gather_hidden_bytes']:.3f}x, "
              f"time {f8['gather_hidden_s'] / bf['gather_hidden_s']:.2f}x; every group: bytes "
              f"{f8['gather_all_bytes'] / bf['gather_all_bytes']:.3f}x, "
              f"time {f8['gather_all_s'] / bf['gather_all_s']:.2f}x; "
              f"whole step {f8['step'] / bf['step']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
