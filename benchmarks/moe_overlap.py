"""Dist-MoE overlap: exposed expert communication with and without chunked overlap, learned vs
forced-balanced routing, expert parallel over world 2 and 4 (gloo, one process per rank).

Each rank trains qwen3_moe (``--flavor``, every rank its own ``--batch`` x ``--seq`` tokens, fp32 or
bf16 autocast, AdamW) with ``parallel.ep_chunks`` 0 (the synchronous uneven exchange), 1 (the
fixed-capacity operation, no overlap) and ``--chunks`` (overlapped), each under learned routing and
forced-balanced routing (round-robin experts, weights 1/k: a different workload -- every expert
gets the same tokens -- so its row is labelled and never compared with a learned row as if it were
the same job). Per row: tokens/s over all ranks, exposed communication per step (``moe/dispatch_wait_s``
+ ``moe/combine_wait_s``, the time rank 0 sat blocked in ``wait`` on the data exchanges; not measured
for ep_chunks 0), the skew wait (``moe/sync_wait_s``: the plan's blocking counts gather, where a rank
waits for the slowest one -- load skew, kept out of the exposed communication),
``moe/hidden_frac`` and the imbalance (max / mean tokens per expert, mean over layers and steps).
Two columns take the skew out: "exposed, last arriver" sums, over every data exchange of a step,
the *smallest* wait over the ranks (:func:`record_timeline` gives each wait; the rank that issued its
part last waited for the transfer alone, not for a peer, so the minimum over ranks is the exposed
transfer with the ranks' lateness taken out); "CPU s/step" is the process CPU time per step (every
thread, gloo's included), mean over ranks -- on a shared host wall time mostly measures who got a core.

    .venv/bin/python benchmarks/moe_overlap.py [--worlds 2,4] [--flavor tiny] [--batch 2] [--seq 128]
        [--chunks 4] [--steps 3] [--dtype fp32] [--capacity-factor 1.25] [--routings learned]
        [--link-mb-per-s 100 --link-latency-us 50] [--link-emulate 50,100]

The configurations run interleaved in rounds (this host's speed drifts) and the table shows medians.
``--capacity-factor f`` adds a learned-routing row with the drop policy (``dropped/step``: token
assignments dropped over the ep group and the MoE layers, per step).

``--link-mb-per-s B`` adds a load-independent column, "modelled exposed s/step (CPU clock)": for a
link that costs no CPU (a NIC / NVLink engine, which this host has not: here every byte of gloo's
loopback transfer is CPU work on the cores the experts run on) taking ``latency + remote bytes / B``
per exchange, the part of each exchange's link time that this rank's own main-thread CPU work
between issuing the exchange and waiting on it does not cover, summed over a step's exchanges (the
synchronous path's too: it waits right away), mean over ranks. Measured on the thread's CPU clock, so
being descheduled by other jobs does not count; peers are taken to be as fast (no skew). It shows
how much link time the chunk pipeline's schedule hides, not what this host's gloo transfers cost.

``--link-emulate LATENCY_US,MB_PER_S`` measures such a link in wall-clock time instead: it sets
``LOCKSTEP_EP_LINK_EMULATION`` (:func:`lockstep.parallel.dist_moe_ops.emulated_link`), under which
every Dist-MoE exchange completes no earlier than its issue + latency + remote bytes / bandwidth
(``wait`` sleeps until then after gloo's own wait: the link's time, not its CPU cost -- gloo's copies
still run on the cores). The exposed-communication and step-time columns then include that link;
the ep_chunks 0 rows are left out (the synchronous exchange is not emulated).
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
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dist_moe_ops import LINK_ENV, emulated_link, record_timeline
from lockstep.parallel.expert import apply_expert_parallel, sync_expert_parallel_grads

ROUTINGS = ("learned", "forced_balanced")


class _LinkWork:
    """An async work that, on ``wait``, adds the link time its issuer's CPU work did not cover."""

    def __init__(self, work, link_s: float, totals: list) -> None:
        self._work, self._link_s, self._totals = work, link_s, totals
        self._issued_cpu = time.thread_time()

    def wait(self) -> bool:
        self._totals[0] += max(0.0, self._link_s - (time.thread_time() - self._issued_cpu))
        return self._work.wait()

    def get_future(self):
        return self._work.get_future()


#: modelled exposed link seconds of this process since the last read (``_model_link``)
_MODELLED = [0.0]


def _model_link(bytes_per_s: float, latency_s: float) -> None:
    """Wrap every ``dist.all_to_all_single`` of this process to add to ``_MODELLED`` (module docstring)."""
    real = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input.shape[0]
        splits = input_split_sizes or [rows // world] * world
        row_bytes = input[0].numel() * input.element_size() if rows else 0
        link_s = latency_s + (rows - splits[rank]) * row_bytes / bytes_per_s
        work = real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if async_op:
            return _LinkWork(work, link_s, _MODELLED)
        _MODELLED[0] += link_s  # waited right away: nothing covers it
        return work

    dist.all_to_all_single = all_to_all_single


def _run(args, routing: str, chunks: int, rank: int, capacity_factor: float = 0.0) -> dict:
    cfg = model_config("qwen3_moe", args.flavor)
    cfg.feed_forward.routing = routing
    model = apply_expert_parallel(build_model(cfg, seed=0), ep_chunks=chunks, capacity_factor=capacity_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    times, cpu, modelled, exposed, last, sync, hidden, imbalance, dropped = [], [], [], [], [], [], [], [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        dist.barrier()
        t0, c0, _MODELLED[0] = time.perf_counter(), time.process_time(), 0.0
        with record_timeline() as events, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(tokens[:, :-1])
            aux, metrics = model.pop_auxiliary()
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + sum(aux.values())
            loss.backward()
        sync_expert_parallel_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        c1 = time.process_time()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(_mean_over_ranks(c1 - c0))
            modelled.append(_mean_over_ranks(_MODELLED[0]))
            if chunks:
                last.append(_last_arriver_wait(events))
            m = {k: float(v) for k, v in metrics.items()}
            if "moe/dispatch_wait_s" in m:  # this forward + the previous step's backward
                exposed.append(m["moe/dispatch_wait_s"] + m["moe/combine_wait_s"])
                sync.append(m["moe/sync_wait_s"])
                hidden.append(m["moe/hidden_frac"])
                dropped.append(m["moe/dropped_tokens"])
            per_layer = [m[k] for k in m if k.endswith("/imbalance") and not k.startswith("moe/")]
            if per_layer:  # the Dist-MoE rows (over the ep group)
                imbalance.append(statistics.mean(per_layer))
    return {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "modelled_s": statistics.median(modelled) if args.link_mb_per_s else None,
            "last_s": statistics.median(last) if last else None,
            "exposed_s": statistics.median(exposed) if exposed else None,
            "sync_s": statistics.median(sync) if sync else None,
            "hidden_frac": statistics.median(hidden) if hidden else None,
            "imbalance": statistics.mean(imbalance) if imbalance else None,
            "dropped": statistics.mean(dropped) if dropped else None}


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _last_arriver_wait(events: list) -> float:
    """Sum over the step's data exchanges of the smallest wait over the ranks (module docstring).
    Every rank waits on the same exchanges in the same order."""
    waits = torch.tensor([t1 - t0 for e, *_, t0, t1 in events if e == "wait"], dtype=torch.float64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([waits.numel()]))
    if len({int(c) for c in counts}) != 1:
        raise RuntimeError(f"ranks waited on different numbers of exchanges: {[int(c) for c in counts]}")
    every = [torch.empty_like(waits) for _ in range(dist.get_world_size())]
    dist.all_gather(every, waits)
    return float(torch.stack(every).min(0).values.sum())


def _worker(rank, world, args, init_file, out_file):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    if args.link_mb_per_s > 0:
        _model_link(args.link_mb_per_s * 1e6, args.link_latency_us * 1e-6)
    chunk_counts = (1, args.chunks) if args.link_emulate else (0, 1, args.chunks)
    configs = [(r, c, 0.0) for r in args.routings.split(",") for c in chunk_counts]
    if args.capacity_factor > 0:
        configs.append(("learned", args.chunks, args.capacity_factor))
    rows: dict = {k: [] for k in configs}
    for _ in range(args.rounds):
        for routing, chunks, factor in configs:
            rows[routing, chunks, factor].append(_run(args, routing, chunks, rank, factor))
    if rank == 0:
        torch.save(rows, out_file)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="also run learned routing, --chunks, with this drop capacity factor")
    p.add_argument("--routings", default=",".join(ROUTINGS))
    p.add_argument("--link-mb-per-s", type=float, default=0.0,
                   help="model a link of this many MB/s that costs no CPU (module docstring); 0: off")
    p.add_argument("--link-latency-us", type=float, default=50.0, help="the modelled link's latency per exchange")
    p.add_argument("--link-emulate", default="", metavar="LATENCY_US,MB_PER_S",
                   help="an emulated link under every Dist-MoE exchange, in wall-clock time (module docstring)")
    args = p.parse_args()
    link = f", modelled link {args.link_mb_per_s:g} MB/s + {args.link_latency_us:g} us" if args.link_mb_per_s else ""
    if args.link_emulate:
        os.environ[LINK_ENV] = args.link_emulate  # the ranks inherit it; every Dist-MoE layer reads it when built
        emulated = emulated_link()
        link += f", emulated link {emulated.latency_s * 1e6:g} us + remote bytes / {emulated.bytes_per_s / 1e6:g} MB/s"
    print(f"qwen3_moe {args.flavor}, {args.dtype}, per rank {args.batch} x {args.seq} tokens, "
          f"{args.threads} thread(s) per rank, host CPUs {os.cpu_count()}, torch {torch.__version__}{link}")
    print("| world | routing | ep_chunks | capacity | tokens/s | step s | CPU s/step | modelled exposed s/step "
          "(CPU clock) | exposed comm s/step | exposed, last arriver s/step | hidden_frac | skew wait s/step "
          "| imbalance max/mean | dropped/step |")
    print("|---" * 14 + "|")
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.pt")
            mp.spawn(_worker, args=(world, args, os.path.join(d, "init"), out), nprocs=world, join=True)
            rows = torch.load(out, weights_only=False)
        for (routing, chunks, factor), runs in rows.items():
            step = statistics.median(r["step_s"] for r in runs)
            label = {0: "0 (sync uneven)", 1: "1 (no overlap)"}.get(chunks, f"{chunks} (overlap)")
            capacity = "no-drop" if factor == 0 else f"factor {factor}"
            cells = [str(world), routing, label, capacity, f"{world * args.batch * args.seq / step:,.0f}",
                     f"{step:.3f}"]
            for key, fmt in (("cpu_s", "{:.3f}"), ("modelled_s", "{:.4f}"), ("exposed_s", "{:.4f}"),
                             ("last_s", "{:.4f}"), ("hidden_frac", "{:.2f}"), ("sync_s", "{:.4f}"),
                             ("imbalance", "{:.2f}"), ("dropped", "{:.0f}")):
                vals = [r[key] for r in runs if r[key] is not None]
                cells.append(fmt.format(statistics.median(vals)) if vals else "-")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
