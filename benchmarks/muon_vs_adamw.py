"""Muon vs AdamW on the ``shakespeare`` recipe (issue #20): loss curves of two runs in one PNG.

The runs (same recipe, seed and steps; only ``--transform optimizer=...`` differs)::

    for opt in adamw muon; do
      OMP_NUM_THREADS=1 .venv/bin/python -m lockstep.cli train --recipe shakespeare --transform optimizer=$opt \\
          --steps 300 --seed 0 --validation.every 50 --output.no-progress --output.no-tensorboard \\
          --run-dir runs/h2-shakespeare300-$opt
    done
    .venv/bin/python benchmarks/muon_vs_adamw.py runs/h2-shakespeare300-adamw runs/h2-shakespeare300-muon \\
        --png docs/images/muon_vs_adamw_shakespeare.png

Prints each run's validation losses (step 0, every ``validation.every`` and the last step), its final
training loss (mean of the last 10 steps) and its median optimizer-stage time per step; plots the
training loss (thin: per step; thick: 10-step moving mean) and the validation loss (markers).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _label(run_dir: Path) -> str:
    transforms = json.loads((run_dir / "manifest.json").read_text()).get("transforms", [])
    names = [t.split("=", 1)[1] for t in transforms if t.startswith("optimizer=")]
    return names[-1] if names else run_dir.name


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--png", default="")
    args = p.parse_args()
    curves = {}
    for run in args.runs:
        records = _records(run)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        opt = [r["time/optimizer"] for r in records if "time/optimizer" in r]
        name = _label(run)
        curves[name] = (train, val)
        last = statistics.fmean(loss for _, loss in train[-10:])
        print(f"{name:>6} ({run}): {len(train)} steps; validation " +
              ", ".join(f"{s}: {v:.3f}" for s, v in val) +
              f"; train loss (last 10 steps) {last:.3f}; optimizer stage median {statistics.median(opt):.3f} s/step")
    if args.png:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7.5, 4.5), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for i, (name, (train, val)) in enumerate(curves.items()):
            color = f"C{i}"
            steps, losses = zip(*train)
            ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, _moving_mean(list(losses), 10), color=color, linewidth=1.8,
                    label=f"{name} train (10-step mean)")
            if val:
                vs, vl = zip(*val)
                ax.plot(vs, vl, color=color, marker="o", linestyle="--", label=f"{name} validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title("shakespeare recipe (llama3 tiny, bf16), seed 0: Muon vs AdamW")
        ax.set_ylim(top=8.6)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, format="png")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
