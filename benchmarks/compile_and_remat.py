"""Compilation and recomputation: step time of each compiled mode vs eager, and the activation-memory frontier.

    .venv/bin/python benchmarks/compile_and_remat.py [--part 1|2|all] [--dtype float32,bfloat16] [--steps 3]
    .venv/bin/python benchmarks/compile_and_remat.py --quick      # debug model, aot_eager backends: a smoke run

Every variant is a real lockstep Trainer built from the ``shakespeare-small`` recipe (llama3 ``small``,
29.4M params; batch 8 x 256 like benchmarks/train_throughput.py) with config overrides, stepped with
``Trainer.train_step`` (forward, loss, backward, clipping, AdamW). All variants of one dtype live in
this process and run interleaved: round r runs ``--steps`` steps of each variant, in an order rotated
every round, and a variant's ratio is the median over rounds of its tokens/s over eager's in the same
round (this 2-vCPU host's speed drifts with load; only same-round ratios mean much).

Part 1 (step time): eager; GraphTrainer (``training.mode=graph``, default passes); GraphTrainer +
the opt-in ``inductor`` pass; per-block compile (``compile.modules=["layers.*"]``); every
``local_compile`` region (``compile.regions``); and the competitor, plain ``torch.compile`` of the
whole model (``model.compile()``). The first step (capture / compilation) is timed apart, then
``--warmup`` steps, then the rounds.

Part 2 (activation memory vs step time): ``training.activation_checkpoint`` none / selective /
regions (``--save`` globs) / full, and the graph trainer with ``graph.memory_budget`` 0.25 / 0.5 /
0.75 (and its default policy). Memory measures are described in benchmarks/_bench_memory.py; the
plot (``--png``) puts step time against the allocator peak of a micro-step.

A variant whose feature is missing prints "not available (why)"; one that fails prints its error.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_memory as memory  # noqa: E402

from lockstep.config.base import ConfigError, set_by_path  # noqa: E402
from lockstep.recipes import get_recipe  # noqa: E402
from lockstep.train.trainer import Trainer  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
DEFAULT_SAVE = ["layers.*.attention", "layers.*.feed_forward.w2"]


@dataclasses.dataclass
class Variant:
    name: str
    #: dotted config path -> value (set with lockstep.config.base.set_by_path)
    overrides: dict[str, object] = dataclasses.field(default_factory=dict)
    #: returns why the feature is missing, or None
    available: Callable[[], str | None] = lambda: None
    #: what must have happened during the first step: "dynamo" (something was compiled), "graph"
    expect: str = ""
    #: plain torch.compile of the whole model (the competitor)
    whole_model_compile: bool = False


# ---------------------------------------------------------------------------- feature probes

def _graph_missing() -> str | None:
    if importlib.util.find_spec("lockstep.graph.capture") is None:
        return "lockstep.graph.capture has not landed"
    return None


def _pass_missing(name: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        from lockstep.graph.passes import registered_passes

        return _graph_missing() or (None if name in registered_passes() else f"no graph pass {name!r} registered")
    return probe


def compile_regions() -> list[str]:
    """Every declared local_compile region."""
    from lockstep.compile.local import known_regions

    return sorted(known_regions())


def _ac_is_section() -> bool:
    from lockstep.train.config import TrainingConfig

    return not isinstance(TrainingConfig().activation_checkpoint, str)


def ac_overrides(mode: str, save: list[str]) -> dict[str, object]:
    """``training.activation_checkpoint`` set to ``mode`` (a string before it became a section)."""
    if not _ac_is_section():
        return {"training.activation_checkpoint": mode}
    out: dict[str, object] = {"training.activation_checkpoint.mode": mode}
    if mode == "regions":
        out["training.activation_checkpoint.save"] = list(save)
    return out


def part1_variants(quick: bool) -> list[Variant]:
    backend = {"compile.backend": "aot_eager"} if quick else {}
    regions = compile_regions()
    return [
        Variant("eager"),
        Variant("graph", {"training.mode": "graph"}, _graph_missing, expect="graph"),
        Variant("graph + inductor", {"training.mode": "graph", "graph.enable": ["inductor"]},
                (lambda: "skipped by --quick: Inductor over the whole step takes minutes to compile here") if quick
                else _pass_missing("inductor"), expect="graph"),
        Variant("compile blocks (layers.*)", {"compile.modules": ["layers.*"], **backend}, expect="dynamo"),
        Variant("compile regions (all)", {"compile.regions": regions, **backend},
                lambda: None if regions else "no local_compile region declared", expect="dynamo"),
        Variant("torch.compile(model)", whole_model_compile=True, expect="dynamo"),
    ]


def part2_variants(save: list[str]) -> list[Variant]:
    regions_missing = (lambda: None if _ac_is_section() else
                       "training.activation_checkpoint is still a string (no 'regions' mode)")
    out = [Variant(f"ac {mode}", ac_overrides(mode, save)) for mode in ("none", "selective")]
    out.append(Variant("ac regions", ac_overrides("regions", save), regions_missing))
    out.append(Variant("ac full", ac_overrides("full", save)))
    out.append(Variant("graph (default policy)", {"training.mode": "graph"}, _graph_missing, expect="graph"))
    for budget in (0.75, 0.5, 0.25):
        out.append(Variant(f"graph budget {budget}", {"training.mode": "graph", "graph.memory_budget": budget},
                           _pass_missing("memory"), expect="graph"))
    return out


# ---------------------------------------------------------------------------- building and stepping

def build_config(args, dtype: str, run_dir: str, overrides: dict[str, object]):
    cfg = get_recipe(args.recipe).config()
    base = {"run_dir": run_dir, "steps": 100_000, "training.dtype": dtype,
            "training.batch_size": args.batch_size, "training.seq_len": args.seq_len,
            "validation.every": 0, "output.progress": False, "output.sample_tokens": 0,
            "output.parity_check": False}
    for path, value in {**base, **overrides}.items():
        cfg = set_by_path(cfg, path, value)
    return cfg


def _graph_took_effect(trainer) -> str | None:
    """Why the first step did not run a captured graph, or None when it did."""
    graph = getattr(trainer.runtime, "graph", None)  # a lockstep.graph.step.GraphStep in graph mode
    if graph is None or not getattr(graph, "captures", 0):
        return "training.mode=graph was accepted but the runtime captured no graph"
    return None


class Bench:
    """One variant's Trainer and its step counter."""

    def __init__(self, variant: Variant, args, dtype: str, root: str) -> None:
        self.variant, self.args = variant, args
        safe = "".join(c if c.isalnum() else "_" for c in variant.name)
        self.trainer = Trainer(build_config(args, dtype, f"{root}/{safe}-{dtype}", variant.overrides))
        if variant.whole_model_compile:
            self.trainer.model.compile(backend="aot_eager" if args.quick else "inductor")
        # local_compile regions are one process-wide switch that each Trainer sets when built: every
        # variant sets its own before it steps (the others run them eager)
        self.regions, self.backend = list(self.trainer.config.compile.regions), self.trainer.config.compile.backend
        self.batches = iter(self.trainer.data.train)
        self.trainer.bench_batches = self.batches
        self.step = 1
        self.wall: list[float] = []  # wall seconds per step of each run() (the first step's first)
        self.tokens = args.batch_size * args.seq_len

    def run(self, n: int, clock) -> float:
        """Seconds per step over ``n`` steps by ``clock``; the wall seconds go to ``self.wall``."""
        self.activate()
        start, wall = clock(), time.perf_counter()
        for _ in range(n):
            self.trainer.train_step(self.step, self.batches)
            self.step += 1
        seconds = (clock() - start) / n
        self.wall.append((time.perf_counter() - wall) / n)
        self.trainer.timer.pop()
        return seconds

    def activate(self) -> None:
        """This variant's local_compile regions on, every other region off."""
        from lockstep.compile.local import enable_regions

        enable_regions(self.regions, self.backend)

    def first_step(self) -> float:
        """The first step's wall seconds (capture / compilation included); checks the feature ran."""
        from torch._dynamo.utils import counters

        graphs_before = counters["stats"]["unique_graphs"]
        seconds = self.run(1, time.perf_counter)
        if self.variant.expect == "dynamo" and counters["stats"]["unique_graphs"] == graphs_before:
            raise Unavailable("the config was accepted but nothing was compiled in the first step")
        if self.variant.expect == "graph":
            why = _graph_took_effect(self.trainer)
            if why:
                raise Unavailable(why)
        return seconds


class Unavailable(Exception):
    pass


def build_all(variants: list[Variant], args, dtype: str, root: str) -> dict[str, Bench]:
    """Each available variant's Bench after its first step; prints why any other is left out."""
    benches: dict[str, Bench] = {}
    for variant in variants:
        why = variant.available()
        if why:
            print(f"  {variant.name:<28} not available ({why})", flush=True)
            continue
        try:
            bench = Bench(variant, args, dtype, root)
            bench.first_seconds = bench.first_step()
        except (Unavailable, ConfigError, NotImplementedError, ImportError) as err:
            print(f"  {variant.name:<28} not available ({type(err).__name__}: {err})", flush=True)
            continue
        except Exception as err:  # a benchmark reports a broken variant and goes on
            print(f"  {variant.name:<28} failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})", flush=True)
            if args.traceback:
                traceback.print_exc()
            continue
        benches[variant.name] = bench
        print(f"  {variant.name:<28} first step {bench.first_seconds:7.2f} s", flush=True)
    return benches


def timed_rounds(benches: dict[str, Bench], args, reference: str) -> dict[str, dict]:
    """Warm-up, then interleaved rounds; per variant: median s/step and median paired ratio to ``reference``."""
    clock = CLOCKS[args.clock]
    if args.warmup:
        for bench in benches.values():
            bench.run(args.warmup, clock)
    names = list(benches)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:  # rotated: each variant goes first in turn
            per_round[name].append(benches[name].run(args.steps, clock))
    out = {}
    for name in names:
        seconds = per_round[name]
        ratios = ([a / b for a, b in zip(per_round[reference], seconds)] if reference in per_round else [])
        median = statistics.median(seconds)
        wall = benches[name].wall[1 + bool(args.warmup):]  # the rounds' wall seconds per step
        out[name] = {"step_s": median, "tokens_per_s": benches[name].tokens / median,
                     "first_step_s": benches[name].first_seconds, "step_wall_s": statistics.median(wall),
                     "ratio": statistics.median(ratios) if ratios else None,
                     "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None}
    return out


def release(benches: dict[str, Bench]) -> None:
    benches.clear()
    gc.collect()
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- the two parts

def part1(args, dtype: str, root: str) -> list[dict]:
    print(f"\n[part 1] step time, {dtype}: building variants (first step = capture / compile)", flush=True)
    benches = build_all(part1_variants(args.quick), args, dtype, root)
    results = timed_rounds(benches, args, "eager")
    release(benches)
    print(f"\n{'variant':<28} {'tok/s':>8} {'ms/step':>8} {'vs eager':>9} {'(range)':>12} "
          f"{'first step s':>13} {'compile s*':>10}   ({args.clock} clock; first step and compile: wall)")
    rows = []
    for name, r in results.items():
        compile_s = r["first_step_s"] - r["step_wall_s"]
        compile_cell = f"{compile_s:>10.2f}" if name != "eager" else f"{'-':>10}"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        span = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}x" if r["ratio"] is not None else ""
        print(f"{name:<28} {r['tokens_per_s']:>8.0f} {1e3 * r['step_s']:>8.1f} {ratio:>9} {span:>12} "
              f"{r['first_step_s']:>13.2f} {compile_cell}", flush=True)
        rows.append({"part": 1, "dtype": dtype, "variant": name, **r, "compile_s": compile_s})
    print("* compile s = first step's wall time - the median step's wall time (capture / compilation, "
          "first-call costs)")
    return rows


def part2(args, dtype: str, root: str) -> list[dict]:
    print(f"\n[part 2] activation memory vs step time, {dtype}: building variants", flush=True)
    benches = build_all(part2_variants(args.save), args, dtype, root)
    results = timed_rounds(benches, args, "ac none")
    rows = []
    for name, bench in benches.items():
        grad_bytes = sum(p.numel() * p.element_size() for p in bench.trainer.model.parameters() if p.requires_grad)
        row = {"part": 2, "grad_bytes": grad_bytes, "dtype": dtype, "variant": name, **results[name]}
        bench.activate()
        row["step_peak_bytes"] = memory.step_peak_bytes(bench.trainer)
        row["held_after_forward_bytes"] = (memory.held_after_forward_bytes(bench.trainer)
                                           if bench.trainer.config.training.mode == "eager" else None)
        graph_mode = bench.trainer.config.training.mode == "graph"
        saved = (memory.graph_saved_bytes(bench.trainer) if graph_mode else None) or {}
        row["graph_saved_bytes_before"], row["graph_saved_bytes"] = saved.get("captured"), saved.get("after")
        row["graph_static_peak_bytes"] = saved.get("static_peak")
        record = (getattr(getattr(bench.trainer.runtime, "graph", None), "records", None) or {}).get("memory", {})
        row["graph_budget_met"] = record.get("budget_met")
        rows.append(row)
    release(benches)
    mib = lambda b: f"{b / 2**20:.1f}" if b is not None else "-"  # noqa: E731

    def saved_cell(row: dict) -> str:
        if row["graph_saved_bytes"] is None:
            return "-"
        met = {True: "", False: " (budget not met)", None: ""}[row["graph_budget_met"]]
        return f"{mib(row['graph_saved_bytes_before'])} -> {mib(row['graph_saved_bytes'])}{met}"

    if rows:
        print(f"\n(the step peak includes the {rows[0]['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients "
              "the backward allocates)")
    print(f"{'variant':<28} {'ms/step':>8} {'vs none':>8} {'step peak MiB':>14} {'held after fwd MiB':>19} "
          f"{'graph saved MiB (captured -> after passes)':>43} {'graph static peak MiB':>22}")
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        print(f"{row['variant']:<28} {1e3 * row['step_s']:>8.1f} {ratio:>8} {mib(row['step_peak_bytes']):>14} "
              f"{mib(row['held_after_forward_bytes']):>19} {saved_cell(row):>43} "
              f"{mib(row['graph_static_peak_bytes']):>22}", flush=True)
    print("step peak: allocator peak during one micro-batch's forward+backward (includes the gradients); "
          "held after fwd: bytes alive after an eager forward; graph saved / static peak: the passes' records "
          "(computed from node shapes)")
    return rows


def plot_frontier(rows: list[dict], out_png: str, title: str, clock: str = "wall") -> None:
    """Step time against the micro-step's allocator peak, one panel per dtype."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dtypes = sorted({r["dtype"] for r in rows})
    fig = Figure(figsize=(6.5 * len(dtypes), 4.8), dpi=100)
    FigureCanvasAgg(fig)
    for index, dtype in enumerate(dtypes, start=1):
        ax = fig.add_subplot(1, len(dtypes), index)
        mine = [r for r in rows if r["dtype"] == dtype]
        for kind, marker, label in (("ac ", "o", "eager, training.activation_checkpoint"),
                                    ("graph", "s", "graph trainer, graph.memory_budget")):
            pts = [r for r in mine if r["variant"].startswith(kind)]
            if not pts:
                continue
            ax.scatter([r["step_peak_bytes"] / 2**20 for r in pts], [1e3 * r["step_s"] for r in pts],
                       marker=marker, label=label)
            for r in pts:
                name = r["variant"].removeprefix("ac ").removeprefix("graph ").replace("budget ", "")
                ax.annotate(name, (r["step_peak_bytes"] / 2**20, 1e3 * r["step_s"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set_title(f"{dtype}")
        ax.set_xlabel("allocator peak of one micro-step (forward + backward), MiB")
        ax.set_ylabel("median step time, ms" + (" (process CPU time)" if clock == "cpu" else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    print(f"wrote {out_png}")


def run_child(args, part: str, dtype: str) -> list[dict]:
    """Rows of one (part, dtype) measured by a fresh process running this script."""
    forward = ["--recipe", args.recipe, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--threads", str(args.threads), "--clock", args.clock, "--save", ",".join(args.save)]
    forward += [flag for flag, on in (("--warm-cache", args.warm_cache), ("--traceback", args.traceback),
                                      ("--quick", args.quick)) if on]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, __file__, *forward, "--part", part, "--dtype", dtype,
                               "--json", out.name, "--child"], check=False)
        if done.returncode != 0:
            print(f"[part {part}, {dtype}] exited with status {done.returncode}", flush=True)
            return []
        return json.loads(Path(out.name).read_text() or "[]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["1", "2", "all"], default="all")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma list")
    parser.add_argument("--recipe", default="shakespeare-small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per round per variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    parser.add_argument("--save", default=",".join(DEFAULT_SAVE), help="save globs of activation_checkpoint regions")
    parser.add_argument("--png", default="docs/images/compile_and_remat_frontier.png")
    parser.add_argument("--json", default="", help="write every row here")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep Inductor's on-disk caches (default: a fresh cache dir, so compile times are cold)")
    parser.add_argument("--traceback", action="store_true", help="print failed variants' tracebacks")
    parser.add_argument("--quick", action="store_true",
                        help="debug recipe, batch 2 x 32, 1 round of 1 step, aot_eager backends: a smoke run")
    parser.add_argument("--plot-json", default="",
                        help="comma list of --json files of earlier runs: only draw --png from their part-2 rows")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one (part, dtype) of a parent
    args = parser.parse_args()
    args.save = [s for s in args.save.split(",") if s]
    if args.quick:
        args.recipe, args.batch_size, args.seq_len = "debug", 2, 32
        args.warmup, args.steps, args.rounds = 0, 1, 1
        if args.png == parser.get_default("png"):
            args.png = os.path.join(tempfile.gettempdir(), "compile_and_remat_quick.png")
    torch.set_num_threads(args.threads)
    if not args.warm_cache and not args.child:  # compile times from scratch: no cache of an earlier run
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_and_remat_inductor_")
    from lockstep.observe._sysinfo import cpu_flags, cpu_model

    print(f"CPU: {cpu_model()} ({', '.join(cpu_flags())}), {args.threads} threads, torch {torch.__version__}; "
          f"load average {os.getloadavg()}")
    print(f"Inductor cache: {'warm (shared)' if args.warm_cache else 'cold (fresh dir)'}")
    print(f"recipe {args.recipe}, batch {args.batch_size} x seq {args.seq_len}, {args.warmup} warm-up steps, "
          f"{args.rounds} rounds x {args.steps} steps per variant, {args.clock} clock")
    if args.plot_json:
        rows = [r for f in args.plot_json.split(",") for r in json.loads(Path(f).read_text()) if r["part"] == 2]
        plot_frontier(rows, args.png, f"{args.recipe}: step time vs activation memory "
                                      f"(batch {args.batch_size} x {args.seq_len})", args.clock)
        return
    jobs = [(part, dtype) for dtype in args.dtype.split(",")
            for part in (["1", "2"] if args.part == "all" else [args.part])]
    rows: list[dict] = []
    if len(jobs) == 1:
        with tempfile.TemporaryDirectory() as root:
            rows = (part1 if jobs[0][0] == "1" else part2)(args, jobs[0][1], root)
    else:  # one process per (part, dtype): Dynamo / Inductor state and the region switch start clean
        for part, dtype in jobs:
            rows += run_child(args, part, dtype)
    print(f"\nload average after: {os.getloadavg()}")
    if args.child:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    if any(r["part"] == 2 for r in rows):
        plot_frontier([r for r in rows if r["part"] == 2], args.png,
                      f"{args.recipe}: step time vs activation memory (batch {args.batch_size} x {args.seq_len})",
                      args.clock)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
