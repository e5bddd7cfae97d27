"""Parallel overhead: step time and bytes communicated per step of each layout vs world 1.

Each layout trains the same debug recipe with the same global batch for a few steps under torchrun
(gloo, one thread per rank, like world 1 here); the median step time after warm-up is read from
its metrics.jsonl. Bytes per step are **measured**: a second pair of runs (``--trace-steps`` and
twice that) goes through ``benchmarks/comm_trace/sitecustomize.py``, which counts the bytes of every
collective the dispatcher runs on each rank (c10d ops behind torch.distributed -- FSDP2, pipelining,
the trainer's reductions -- and DTensor's functional collectives -- TP, EP -- forward and backward);
their difference over the extra steps is the steady-state traffic of one step (setup collectives
cancel). Rank 0's count is printed next to ``lockstep plan``'s estimate for rank 0's stage (the sum
of its collectives' tensor sizes, before ring factors). This machine has 2 cores, so worlds 2 and 4
cannot show a speed-up: the ratio is the price of the layout's communication and bookkeeping.

    .venv/bin/python benchmarks/parallel_overhead.py [--steps 8] [--only tp=2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lockstep.parallel.tested_layouts import BALANCING, degree_flags

TRACE_DIR = Path(__file__).resolve().parent / "comm_trace"

# name, recipe, world, degrees (ParallelConfig fields), extra model flags
LAYOUTS: list[tuple[str, str, int, dict, list[str]]] = [
    ("world 1", "debug", 1, {}, []),
    ("dp_shard=2", "debug", 2, {"dp_shard": 2}, []),
    ("dp_replicate=2", "debug", 2, {"dp_replicate": 2, "dp_shard": 1}, []),
    ("tp=2", "debug", 2, {"tp": 2}, []),
    ("pp=2 1F1B", "debug", 2, {"pp": 2}, []),
    ("cp=2", "debug", 2, {"cp": 2}, []),
    ("world 1 (qwen3)", "debug-qwen3", 1, {}, []),
    ("pp=2 x tp=2 (qwen3, tied)", "debug-qwen3", 4, {"pp": 2, "tp": 2}, []),
    ("cp=2 x tp=2 (qwen3)", "debug-qwen3", 4, {"cp": 2, "tp": 2}, []),
    ("world 1 (moe)", "debug-moe", 1, {}, []),
    ("ep=2 x dp_shard=2 (moe)", "debug-moe", 2, {"dp_shard": 2, "ep": 2}, []),
    ("tp=2 (moe, expert TP)", "debug-moe", 2, {"tp": 2}, []),
    ("tp=2 x ep=2 (moe)", "debug-moe", 4, {"dp_shard": 2, "ep": 2, "tp": 2}, []),
    ("HSDP 2x2 x ep=2 (moe)", "debug-moe", 4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, []),
    ("ep=4 over dp_shard=2 x cp=2 (moe)", "debug-moe", 4, {"dp_shard": 2, "cp": 2, "ep": 4}, []),
    ("world 1 (deepseek)", "debug-deepseek", 1, {}, BALANCING),
    ("tp=2 (deepseek, MLA)", "debug-deepseek", 2, {"tp": 2}, BALANCING),
    ("pp=2 x ep=2 (deepseek, MTP)", "debug-deepseek", 4, {"pp": 2, "dp_shard": 2, "ep": 2}, BALANCING),
]


def _train(run_dir: Path, recipe: str, world: int, degrees: dict, extra: list[str], steps: int, args,
           env: dict | None = None) -> Path:
    cmd = [sys.executable, "-m", "lockstep.cli", "train", "--recipe", recipe, "--run-dir", str(run_dir),
           "--steps", str(steps), "--validation.every", "0", "--output.no-progress",
           "--output.sample-tokens", "0", "--output.no-save-weights", "--output.no-parity-check",
           "--training.batch-size", str(args.batch_size), "--training.seq-len", str(args.seq_len),
           *degree_flags(degrees), *extra]
    if world > 1:
        cmd += ["--nproc", str(world)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir.name} failed:\n{proc.stderr[-2000:]}")
    return run_dir


def step_seconds(root: Path, name: str, recipe: str, world: int, degrees: dict, extra: list[str], args) -> float:
    run_dir = _train(root / f"{_slug(name)}-time", recipe, world, degrees, extra, args.steps, args)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/step"] for r in records if "time/step" in r][2:]  # skip warm-up steps
    return statistics.median(times)


def measured_bytes(root: Path, name: str, recipe: str, world: int, degrees: dict, extra: list[str],
                   args) -> dict[str, float]:
    """Rank 0's bytes per step by collective kind, from runs of n and 2n steps under the trace."""
    totals = []
    for steps in (args.trace_steps, 2 * args.trace_steps):
        out = root / f"{_slug(name)}-trace{steps}"
        out.mkdir()
        env = {"PYTHONPATH": os.pathsep.join([str(TRACE_DIR), os.environ.get("PYTHONPATH", "")]),
               "LOCKSTEP_BENCH_COMM_DIR": str(out)}
        _train(root / f"{_slug(name)}-run{steps}", recipe, world, degrees, extra, steps, args, env)
        totals.append(json.loads((out / "rank0.json").read_text())["bytes"])
    kinds = set(totals[0]) | set(totals[1])
    per_step = {k: (totals[1].get(k, 0) - totals[0].get(k, 0)) / args.trace_steps for k in kinds}
    return {k: v for k, v in per_step.items() if v}


def planned_bytes(recipe: str, world: int, degrees: dict, args) -> float | None:
    """``lockstep plan``'s bytes per step of rank 0 (tensor sizes of its collectives), or None if it
    cannot size the layout."""
    from lockstep.config.base import ConfigError
    from lockstep.parallel.plan import Layout, build_plan
    from lockstep.recipes import get_recipe

    layout = {k: v for k, v in degrees.items() if k in ("pp", "dp_replicate", "dp_shard", "tp", "ep", "cp")}
    try:
        plan = build_plan(get_recipe(recipe).config().model, Layout(world=world, **layout), seq_len=args.seq_len,
                          batch_size=args.batch_size, compute_dtype="fp32")
    except ConfigError as err:
        print(f"  plan: {err}", file=sys.stderr)
        return None
    return sum(c.bytes_per_step for c in plan.stages[plan.layout.coords(0)["pp"]].collectives)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trace-steps", type=int, default=2, help="bytes: runs of n and 2n steps")
    parser.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--only", action="append", help="run only layouts whose name contains this (repeatable)")
    args = parser.parse_args()
    print(f"debug recipes, global batch {args.batch_size} x {args.seq_len}, fp32, median of steps 3..{args.steps}, "
          "1 thread per rank; bytes: rank 0 per step, measured vs lockstep plan")
    print(f"{'layout':<34} {'step ms':>9} {'vs world 1':>11} {'measured':>12} {'planned':>12}  measured by kind")
    base: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, recipe, world, degrees, extra in LAYOUTS:
            if args.only and world > 1 and not any(o in name for o in args.only):
                continue
            try:
                seconds = step_seconds(root, name, recipe, world, degrees, extra, args)
            except RuntimeError as err:
                print(f"{name:<34} FAILED: {str(err).strip().splitlines()[-1][:160]}", flush=True)
                continue
            if world == 1:
                base[recipe] = seconds
                print(f"{name:<34} {seconds * 1e3:>9.1f} {1.0:>10.2f}x {'0':>12} {'0':>12}", flush=True)
                continue
            kinds = measured_bytes(root, name, recipe, world, degrees, extra, args)
            planned = planned_bytes(recipe, world, degrees, args)
            ratio = f"{seconds / base[recipe]:>10.2f}x" if recipe in base else f"{'-':>11}"
            detail = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(kinds.items()))
            print(f"{name:<34} {seconds * 1e3:>9.1f} {ratio} {_mib(sum(kinds.values())):>12} "
                  f"{_mib(planned) if planned is not None else 'n/a':>12}  {detail}", flush=True)


if __name__ == "__main__":
    main()
