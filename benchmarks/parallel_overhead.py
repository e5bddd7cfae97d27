"""Parallel overhead: step time and communication per step of each layout at world 2 vs world 1.

Each layout trains the same recipe with the same global batch for a few steps under torchrun
(gloo, one thread per rank, like world 1 here), and the median step time after warm-up is read
from its metrics.jsonl. Bytes communicated per rank per step are the analytical ring estimates of
``lockstep plan`` for the same layout (context parallel is not modelled there). This machine has
2 cores, so world 2 cannot show a speed-up: the ratio is the price of the layout's communication
and bookkeeping, reported as it is.

    .venv/bin/python benchmarks/parallel_overhead.py [--steps 8] [--recipe debug]
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

LAYOUTS = [
    ("world 1", "debug", 1, [], {}),
    ("dp_shard=2", "debug", 2, ["--parallel.dp-shard", "2"], {"dp_shard": 2}),
    ("dp_replicate=2", "debug", 2, ["--parallel.dp-replicate", "2", "--parallel.dp-shard", "1"],
     {"dp_replicate": 2, "dp_shard": 1}),
    ("tp=2", "debug", 2, ["--parallel.tp", "2"], {"tp": 2, "dp_shard": 1}),
    ("pp=2 1F1B", "debug", 2, ["--parallel.pp", "2"], {"pp": 2, "dp_shard": 1}),
    ("cp=2", "debug", 2, ["--parallel.cp", "2"], None),
    ("world 1 (moe)", "debug-moe", 1, [], {}),
    ("ep=2 x dp_shard=2 (moe)", "debug-moe", 2, ["--parallel.ep", "2", "--parallel.dp-shard", "2"],
     {"dp_shard": 2, "ep": 2}),
]


def run_layout(root: Path, name: str, recipe: str, nproc: int, flags: list[str], args) -> float:
    run_dir = root / name.replace(" ", "_").replace("=", "")
    cmd = [sys.executable, "-m", "lockstep.cli", "train", "--recipe", recipe, "--run-dir", str(run_dir),
           "--steps", str(args.steps), "--validation.every", "0", "--output.no-progress",
           "--output.sample-tokens", "0", "--output.no-save-weights", "--output.no-parity-check",
           "--training.batch-size", str(args.batch_size), "--training.seq-len", str(args.seq_len), *flags]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/step"] for r in records if "time/step" in r][2:]  # skip warm-up steps
    return statistics.median(times)


def planned_traffic(recipe: str, degrees: dict | None, nproc: int, args) -> float | None:
    if degrees is None:
        return None
    from lockstep.parallel.plan import Layout, build_plan
    from lockstep.recipes import get_recipe

    plan = build_plan(get_recipe(recipe).config().model, Layout(world=nproc, **degrees),
                      seq_len=args.seq_len, batch_size=args.batch_size)
    return plan.worst.traffic_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    print(f"debug recipes, global batch {args.batch_size} x {args.seq_len}, median of steps 3..{args.steps}, "
          "1 thread per rank")
    print(f"{'layout':<26} {'step ms':>9} {'vs world 1':>11} {'comm/rank/step':>15}")
    base: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe, nproc, flags, degrees in LAYOUTS:
            seconds = run_layout(Path(tmp), name, recipe, nproc, flags, args)
            if nproc == 1:
                base[recipe] = seconds
            traffic = planned_traffic(recipe, degrees, nproc, args) if nproc > 1 else 0.0
            comm = "not modelled" if traffic is None else f"{traffic / 2**20:.2f} MiB"
            print(f"{name:<26} {seconds * 1e3:>9.1f} {seconds / base[recipe]:>10.2f}x {comm:>15}", flush=True)


if __name__ == "__main__":
    main()
