"""Loss-curve check of low-precision training (issue #21): the `shakespeare` recipe in bf16, FP8
(rowwise) and MXFP8, same seed, one process; final validation loss of each low-precision run vs bf16's
(pass: within 2%), step times, and the curves in one PNG.

    .venv/bin/python benchmarks/low_precision.py            # 300 steps, docs/images/low_precision_loss.png

On CPU the FP8 / MXFP8 GEMMs are emulated in torch (quantise, dequantise, float32 GEMM): slower than
bf16, and the step-time ratios printed here measure the emulation, not FP8 hardware.
Each finished variant is written to ``<out>/<variant>.json`` at once (a partial run keeps its results);
the table and the PNG cover every variant file in ``<out>``, so variants may also run as separate
processes (``--variants mxfp8``) and be tabled afterwards with ``--report-only``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

VARIANTS = {"bf16": "none", "fp8_rowwise": "fp8_rowwise", "mxfp8": "mxfp8"}
TOLERANCE = 0.02  # the issue's bar: final validation loss within 2% of bf16's


def run_variant(name: str, fmt: str, steps: int, val_every: int, out: Path, threads: int = 0,
                val_batches: int | None = None, warmup: int | None = None) -> dict:
    from lockstep.observe import read_metrics
    from lockstep.recipes import get_recipe
    from lockstep.train.trainer import Trainer

    cfg = get_recipe("shakespeare").config()
    cfg.steps = steps
    cfg.validation.every = val_every
    cfg.training.threads = threads
    if val_batches is not None:
        cfg.validation.batches = val_batches
    if warmup is not None:
        cfg.lr_schedule.warmup_steps = warmup
    cfg.low_precision.format = fmt
    cfg.run_dir = str(out / name)
    cfg.output.progress = False
    cfg.output.sample_tokens = 0
    cfg.output.save_weights = False
    cfg.output.parity_check = False
    trainer = Trainer(cfg)
    cpu_started = time.process_time()
    result = trainer.fit()
    cpu_s = time.process_time() - cpu_started  # this process's CPU time: what a loaded host cannot inflate
    records = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    step_times = [r["time/step"] for r in records if "time/step" in r][5:]  # first steps warm up
    return {
        "format": fmt,
        "steps": steps,
        "converted_layers": len(trainer.low_precision.converted) if trainer.low_precision else 0,
        "emulated": bool(trainer.low_precision and trainer.low_precision.emulated),
        "train_loss": [(r["step"], r["loss"]) for r in records if "loss" in r],
        "val_loss": sorted(result.val_losses.items()),
        "final_val_loss": result.val_losses[max(result.val_losses)],
        "median_step_s": statistics.median(step_times) if step_times else None,
        "cpu_s_per_step": cpu_s / steps,  # validation included
    }


def load_variant(out: Path, name: str) -> dict | None:
    """A variant's results: its finished ``<name>.json``, else what its run dir's metrics hold so far
    (a run stopped early: no CPU time, step times from the steps it logged)."""
    path = out / f"{name}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "finished": True}
    metrics = out / name / "metrics.jsonl"
    if not metrics.exists():
        return None
    from lockstep.observe import read_metrics

    records = read_metrics(metrics)
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not val:
        return None
    manifest = json.loads((out / name / "manifest.json").read_text())
    step_times = [r["time/step"] for r in records if "time/step" in r][5:]
    return {"format": VARIANTS[name], "finished": False,
            "converted_layers": len((manifest.get("low_precision") or {}).get("layers", {})),
            "train_loss": [(r["step"], r["loss"]) for r in records if "loss" in r], "val_loss": val,
            "median_step_s": statistics.median(step_times) if step_times else float("nan"),
            "cpu_s_per_step": float("nan")}


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        steps, losses = zip(*r["train_loss"])
        line, = ax.plot(steps, losses, alpha=0.35, linewidth=0.8)
        vs, vl = zip(*r["val_loss"])
        ax.plot(vs, vl, "o-", color=line.get_color(), label=f"{name} val ({r['final_val_loss']:.4f} at step {r['compared_at']})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("shakespeare recipe: bf16 vs FP8 rowwise vs MXFP8 (CPU, emulated)")
    ax.legend()
    ax.grid(alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/lockstep_low_precision"))
    parser.add_argument("--val-batches", type=int, default=None, help="validation batches (default: the recipe's 16)")
    parser.add_argument("--warmup", type=int, default=None, help="LR warmup steps (default: the recipe's 50)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    parser.add_argument("--report-only", action="store_true", help="table + PNG from <out>'s variant files")
    parser.add_argument("--png", type=Path, default=Path("docs/images/low_precision_loss.png"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in [] if args.report_only else args.variants:
        r = run_variant(name, VARIANTS[name], args.steps, args.val_every, args.out, args.threads,
                        args.val_batches, args.warmup)
        (args.out / f"{name}.json").write_text(json.dumps(r, indent=1))
        print(f"{name}: final val loss {r['final_val_loss']:.4f}, median step {r['median_step_s']:.3f} s", flush=True)
    results = {name: load_variant(args.out, name) for name in VARIANTS}
    results = {name: r for name, r in results.items() if r is not None}
    # compared at the last validation step every variant reached (the final step of finished runs)
    at = min(max(step for step, _ in r["val_loss"]) for r in results.values())
    for r in results.values():
        r["final_val_loss"], r["compared_at"] = dict(r["val_loss"])[at], at
    plot(results, args.png)
    base = results.get("bf16")
    print(f"\nvalidation loss compared at step {at}"
          + ("" if all(r.get("finished") for r in results.values()) else " (some runs unfinished: partial)"))
    print(f"\n{'variant':<12} {'layers':>6} {'val loss':>10} {'vs bf16':>9} {'step s':>8} {'step x bf16':>12} "
          f"{'cpu s/step':>10} {'cpu x bf16':>10} pass")
    for name, r in results.items():
        rel = r["final_val_loss"] / base["final_val_loss"] - 1 if base else float("nan")
        slow = r["median_step_s"] / base["median_step_s"] if base else float("nan")
        cpu_s = r.get("cpu_s_per_step", float("nan"))  # absent from runs that stopped early
        cpu = cpu_s / base.get("cpu_s_per_step", float("nan")) if base else float("nan")
        ok = "-" if name == "bf16" or not base else ("yes" if abs(rel) <= TOLERANCE else "NO")
        print(f"{name:<12} {r['converted_layers']:>6} {r['final_val_loss']:>10.4f} {rel:>+9.2%} "
              f"{r['median_step_s']:>8.3f} {slow:>12.2f} {cpu_s:>10.3f} {cpu:>10.2f} {ok}")
    print(f"\nplot: {args.png}; results: {args.out}/<variant>.json")


if __name__ == "__main__":
    main()
