"""RL step time, split into generation / training / weight sync / waiting: synchronous
(``max_offpolicy_steps=0``) vs asynchronous (``max_offpolicy_steps=1``) on the same recipe.

Each mode is a full ``lockstep rl`` job (trainer + one generator process under torchrun, one thread
each), run in ABBA order (sync, async, async, sync) so host drift hits both alike; per mode the
median of its steps after the first ``--skip`` is reported, and the speed-up is sync / async
median step time. "generating" is the generator's time for the batch the step trained on (it
overlaps training when asynchronous); "waiting" is the trainer's time blocked on rollouts.

    .venv/bin/python benchmarks/rl_step.py --recipe rl-arith-tiny --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = ["time/step", "time/generating", "time/training", "time/weight_sync", "time/waiting"]


def run_mode(recipe: str, steps: int, staleness: int, extra: list[str], root: Path, tag: str) -> list[dict]:
    run_dir = root / f"{tag}-s{staleness}"
    cmd = [sys.executable, "-m", "lockstep.cli", "rl", "--recipe", recipe, "--steps", str(steps),
           "--run-dir", str(run_dir), "--workers.generators", "1", "--workers.max-offpolicy-steps", str(staleness),
           "--task.eval-every", "0", "--sft.steps", "0", "--output.no-progress", "--output.no-save-weights", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/mean" in r]


def summarise(records: list[dict], skip: int) -> dict[str, float]:
    kept = [r for r in records if r["step"] > skip]
    out = {p: statistics.median(r[p] for r in kept) for p in PARTS}
    out["policy_lag/max"] = max(r["policy_lag/max"] for r in kept)
    out["generator/tokens_per_s"] = statistics.median(r["generator/tokens_per_s"] for r in kept)
    out["trainer/tokens_per_s"] = statistics.median(r["trainer/tokens_per_s"] for r in kept)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="rl-arith-tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the medians (start-up)")
    parser.add_argument("extra", nargs="*", help="more `lockstep rl` field flags (after --)")
    args = parser.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rl-step-") as tmp:
        root = Path(tmp)
        results: dict[int, list[dict]] = {0: [], 1: []}
        started = time.time()
        for i, staleness in enumerate([0, 1, 1, 0]):
            results[staleness].append(summarise(run_mode(args.recipe, args.steps, staleness, args.extra, root,
                                                         f"r{i}"), args.skip))
    print(f"recipe {args.recipe}, {args.steps} steps per run (median of steps > {args.skip}), "
          f"load average before {load[0]:.1f}, {time.time() - started:.0f} s")
    header = "| mode | run | " + " | ".join(p.removeprefix("time/") + " s" for p in PARTS) + \
        " | lag max | generator tok/s | trainer tok/s |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for staleness, name in ((0, "sync (max_offpolicy_steps=0)"), (1, "async (max_offpolicy_steps=1)")):
        for run, s in enumerate(results[staleness]):
            cells = " | ".join(f"{s[p]:.3f}" for p in PARTS)
            print(f"| {name} | {run + 1} | {cells} | {s['policy_lag/max']} | {s['generator/tokens_per_s']:.0f} | "
                  f"{s['trainer/tokens_per_s']:.0f} |")
    sync = statistics.median(s["time/step"] for s in results[0])
    asyn = statistics.median(s["time/step"] for s in results[1])
    print(f"\nspeed-up (sync / async median step time): {sync / asyn:.2f}x ({sync:.3f} s -> {asyn:.3f} s)")


if __name__ == "__main__":
    main()
