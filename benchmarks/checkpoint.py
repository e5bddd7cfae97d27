"""Checkpointing: lockstep's async Checkpointer vs torch.distributed.checkpoint, same state, same run.

The state is an FSDP2 llama3 model (2 ranks, torchrun, gloo, one thread per rank) and its AdamW
state after one optimizer step. In rounds (rotating order, every save into a fresh directory on
the same disk, dirty pages flushed and a pause between saves so no two writes overlap) it is saved by

- ``lockstep``: ``Checkpointer(mode="process")``: slots built as the Trainer builds them, ``save``
  (stage into shared memory, hand off), then ``wait()`` (shards + index fsynced and published);
- ``dcp_sync``: ``get_state_dict`` + ``dcp.save``;
- ``dcp_async_thread``: ``get_state_dict`` + ``dcp.async_save`` (the default: thread executor, a
  fresh staging copy per save), durable at ``future.result()``;
- ``dcp_async_process``: the same with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``;
- ``dcp_async_process_shm``: that plus a reused ``DefaultStager(StagingOptions(use_shared_memory=
  True))``: cached staging buffers in shared memory, DCP's best CPU configuration;
- ``tckpt_async``: torch-checkpointing's ``CheckpointManager`` (async saver: background staging
  thread into shared memory, writer process), pinned memory and non-blocking copies off (CPU),
  O_DIRECT off (ext4 refuses its unaligned writes); no resharder, which needs CUDA (see
  ``tckpt_manager`` in the worker), so it has no resharded load. Optional: ``pip install -c
  constraints.txt -e '.[bench]'``; without it its rows are skipped.

Blocking is what the training loop waits for (state-dict/slot construction included: the Trainer
pays it every save), durable is until the checkpoint is on disk and visible; both are the slower
rank's. Round 0 (first saves: shared-memory allocation, DCP's daemon start-up) is reported apart.
Then loads: the same 2-rank layout (lockstep ``Checkpointer.load`` vs ``get_state_dict`` +
``dcp.load`` + ``set_state_dict`` vs ``CheckpointManager.load`` + ``set_state_dict``) and resharded
2 -> 1 process (the same calls on an unsharded model + AdamW), every loaded tensor compared bitwise
with the saved state. Then a training loop in the same processes: 8 steps per method with an async
save after every step, and without saves, in 3 passes (order reversed every other pass): the
iteration time and the step's compute alone, whose growth is what the background writing costs
training. ``LOCKSTEP_CKPT_WRITER_PRIORITY=idle`` runs lockstep's writer at idle priority
(lockstep/checkpoint/background.py), for an A/B. Last, ``lockstep train``
on the same model (FSDP2 x 2) with a checkpoint after every step and without: the blocking the
Trainer itself records (``checkpoint/blocking_ms``) and the step time around background writes.

    .venv/bin/python benchmarks/checkpoint.py [--quick] [--rounds 5] [--dir DIR] [--drop-caches] [--no-trainer]
        [--loop-steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("_checkpoint_worker.py")
DCP = ["dcp_sync", "dcp_async_thread", "dcp_async_process", "dcp_async_process_shm"]
OTHERS = [*DCP, "tckpt_async"]  # every competitor lockstep's saves are compared with


def filesystem(path: Path) -> str:
    """'<device> <fstype> on <mount point>' for the mount holding ``path``."""
    best = ("?", "?", "/")
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                best = (dev, fstype, mnt)
    return f"{best[0]} {best[1]} on {best[2]}"


def run(cmd: list[str], env: dict) -> None:
    """Run a phase, passing its output through minus the DCP daemon's per-save INFO log lines."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if " - root - INFO - " not in line:
            print(line, end="", flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"benchmark phase failed (exit {proc.returncode}): {' '.join(cmd)}")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~45 MB of state, 1 round (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed save rounds per method (default 5)")
    parser.add_argument("--load-rounds", type=int, default=None, help="load rounds per method (default 3)")
    parser.add_argument("--dir", default=None, help="parent of the scratch directory (default: $TMPDIR or /tmp)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between saves (after os.sync())")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the page cache before each load (root only): cold reads")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled extra lockstep save")
    parser.add_argument("--no-trainer", action="store_true",
                        help="skip the training-loop runs (lockstep train with and without --checkpoint-every 1)")
    parser.add_argument("--loop-steps", type=int, default=None,
                        help="training-loop steps per method, the first 2 not timed (default 8; 0: skip)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    load_rounds = args.load_rounds if args.load_rounds is not None else (1 if args.quick else 3)

    scratch = Path(tempfile.mkdtemp(prefix="lockstep-ckpt-bench-", dir=args.dir))
    fs = filesystem(scratch)
    print(f"scratch: {scratch} ({fs})", flush=True)
    if " tmpfs " in f" {fs} ":
        print("  warning: tmpfs is memory, not a disk: durable times will not include a disk write", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        sharded_json, reshard_json = scratch / "sharded.json", scratch / "reshard.json"
        common = ["--root", str(scratch), "--size", size, "--load-rounds", str(load_rounds)]
        if args.drop_caches:
            common.append("--drop-caches")
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
             "sharded", *common, "--out", str(sharded_json), "--rounds", str(rounds), "--settle", str(args.settle),
             "--loop-steps", str(args.loop_steps if args.loop_steps is not None else (4 if args.quick else 8)),
             *([] if args.no_profile else ["--profile"])], env)
        run([sys.executable, str(WORKER), "reshard", *common, "--out", str(reshard_json),
             "--sharded-json", str(sharded_json)], {**env, "OMP_NUM_THREADS": "2"})
        trainer = None if args.no_trainer else trainer_runs(scratch, args.quick, env)
        sharded = json.loads(sharded_json.read_text())
        report(sharded, json.loads(reshard_json.read_text()), fs, rounds, args)
        if sharded.get("loop"):
            report_loop(sharded["loop"])
        if trainer:
            report_trainer(trainer, args.quick)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


TRAIN_STEPS = 8


def trainer_runs(scratch: Path, quick: bool, env: dict) -> dict:
    """``lockstep train`` (FSDP2 x 2) with a checkpoint after every step, and without: the blocking
    the Trainer records, and what the background writes cost the steps around them."""
    model = ["--transform", "flavor=tiny", "--transform", "layers=2"] if quick else ["--transform", "flavor=small"]
    out = {}
    for name, extra in (("checkpoint every step", ["--checkpoint-every", "1", "--checkpoint.keep", "1"]),
                        ("no checkpoints", [])):
        run_dir = scratch / ("train-ckpt" if extra else "train-plain")
        print(f"training loop: {name} ...", flush=True)
        run([sys.executable, "-m", "lockstep.cli", "train", "--recipe", "debug", *model, "--nproc", "2",
             "--parallel.dp-shard", "2", "--steps", str(TRAIN_STEPS), "--training.batch-size", "2",
             "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0",
             "--output.no-save-weights", "--output.no-parity-check", "--run-dir", str(run_dir), *extra], env)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[name] = {"step_s": [r["time/step"] for r in records if "time/step" in r],
                     "saves": [r for r in records if "checkpoint/step" in r]}
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def report_trainer(t: dict, quick: bool) -> None:
    saves = t["checkpoint every step"]["saves"]
    later = saves[1:]
    first = saves[0]["checkpoint/blocking_ms"] if saves else float("nan")
    with_ckpt = med(t["checkpoint every step"]["step_s"][2:])
    without = med(t["no checkpoints"]["step_s"][2:])
    print(f"\nTrainer (lockstep train, llama3 {'tiny, 2 layers' if quick else 'small'}, FSDP2 x 2, batch 2, "
          f"{TRAIN_STEPS} steps, checkpoint every step; rank 0's metrics.jsonl):")
    print(f"  checkpoint/blocking_ms: first {first:.1f}, median of the rest "
          f"{med([r['checkpoint/blocking_ms'] for r in later]):.1f}; median waited_ms "
          f"{med([r['checkpoint/waited_ms'] for r in later]):.1f}; median write_s "
          f"{med([r['checkpoint/write_s'] for r in later]):.2f}; {len(saves)} saves, none failed: "
          f"{not any('checkpoint/error' in r for r in saves)}")
    print(f"  median time/step (steps 3..): {with_ckpt:.2f} s with a save every step vs {without:.2f} s without "
          f"({with_ckpt / without:.2f}x: the background writer shares the 2 vCPUs)")


def report_loop(loop: dict) -> None:
    base_iter, base_step = med(loop["none"]["iter_s"]), med(loop["none"]["step_s"])
    print(f"\ntraining loop (same processes, FSDP2 x 2, an async save after every step; median of "
          f"{len(loop['none']['iter_s'])} steps over 3 passes, slower rank)")
    print(f"{'method':<24} {'iteration s':>12} {'slowdown':>9} {'step compute s':>15} {'slowdown':>9}")
    for m, t in loop.items():
        it, st = med(t["iter_s"]), med(t["step_s"])
        print(f"{m:<24} {it:>12.3f} {it / base_iter:>8.2f}x {st:>15.3f} {st / base_step:>8.2f}x")
    if "lockstep" in loop:
        mine = med(loop["lockstep"]["iter_s"])
        for m in loop:
            if m not in ("none", "lockstep"):
                other = med(loop[m]["iter_s"])
                print(f"target lockstep's slowdown < {m}'s: {'MET' if mine < other else 'NOT MET'} "
                      f"({mine / base_iter:.2f}x vs {other / base_iter:.2f}x)")


def report(s: dict, r: dict, fs: str, rounds: int, args) -> None:
    flavor, changes = s["flavor"]
    print(f"\nllama3 {flavor}{' ' + str(changes) if changes else ''}: {s['params'] / 1e6:.1f}M params, "
          f"model fp32 + AdamW state {s['state_bytes'] / 1e6:.0f} MB over {s['world']} ranks (FSDP2, gloo); "
          f"torch {s['torch']}; {fs}; median of {rounds} rounds")
    rows = {}
    print(f"\n{'method':<24} {'first blocking ms':>18} {'blocking ms':>12} {'range':>19} {'durable s':>10} "
          f"{'range':>13} {'on disk MB':>11}")
    for v, recs in s["rounds"].items():
        b = [x["blocking_s"] * 1e3 for x in recs]
        d = [x["durable_s"] for x in recs]
        rows[v] = (med(b), med(d))
        first = s["first"].get(v, {}).get("blocking_s", float("nan")) * 1e3
        print(f"{v:<24} {first:>18.1f} {med(b):>12.1f} {min(b):>8.1f}-{max(b):<10.1f} {med(d):>10.2f} "
              f"{min(d):>6.2f}-{max(d):<6.2f} {s['dir_bytes'].get(v, 0) / 1e6:>11.0f}")
    ls = s["rounds"].get("lockstep")
    if ls:
        inside = med([max(p["inside_save_ms"] for p in x["per_rank"]) for x in ls])
        slots = med([max(p["slots_s"] for p in x["per_rank"]) for x in ls]) * 1e3
        write = med([max(p["write_s"] for p in x["per_rank"]) for x in ls])
        dcp_sd = {v: med([max(p["state_dict_s"] for p in x["per_rank"]) for x in s["rounds"][v]]) * 1e3
                  for v in DCP if v in s["rounds"]}
        print("\nDCP get_state_dict (part of its blocking): "
              + ", ".join(f"{v} {ms:.1f} ms" for v, ms in dcp_sd.items()))
        print(f"lockstep blocking = slot construction {slots:.1f} ms + inside save() {inside:.1f} ms "
              f"(SaveStats.blocking_ms); background write (SaveStats.write_s) {write:.2f} s")
    if "lockstep" in rows:
        lb, ld = rows["lockstep"]
        print(f"\n{'ratio lockstep / ...':<24} {'blocking':>10} {'durable':>10}")
        for v in OTHERS:
            if v in rows:
                print(f"{v:<24} {lb / rows[v][0]:>9.3f}x {ld / rows[v][1]:>9.2f}x")
        if "dcp_sync" in rows:
            ok1 = lb <= rows["dcp_sync"][0] / 10
            print(f"\ntarget blocking <= 1/10 of dcp_sync: {'MET' if ok1 else 'NOT MET'} "
                  f"({lb:.1f} ms vs {rows['dcp_sync'][0] / 10:.1f} ms)")
        for v in ("dcp_async_thread", "dcp_async_process", "dcp_async_process_shm", "tckpt_async"):
            if v in rows:
                print(f"target blocking < {v} blocking: {'MET' if lb < rows[v][0] else 'NOT MET'} "
                      f"({lb:.1f} ms vs {rows[v][0]:.1f} ms)")
    cold = "cold page cache" if args.drop_caches else "warm page cache (just written)"
    print(f"\nloads ({cold}), median seconds, slower rank; every loaded tensor bitwise equal to the saved state")
    print(f"{'load':<30} {'lockstep s':>11} {'DCP s':>8} {'tckpt s':>8} {'lockstep / DCP':>15} "
          f"{'lockstep / tckpt':>17}")
    for name, loads in (("same layout (2 ranks)", s["loads"]), ("resharded 2 -> 1 process", r["loads"])):
        a, b, c = med(loads["lockstep"]), med(loads["dcp"]), med(loads.get("tckpt", []))
        tc = f"{c:>8.2f}" if loads.get("tckpt") else f"{'n/a':>8}"
        rc = f"{a / c:>16.2f}x" if loads.get("tckpt") else f"{'n/a (needs CUDA)':>17}"
        print(f"{name:<30} {a:>11.2f} {b:>8.2f} {tc} {a / b:>14.2f}x {rc}")
        if name.startswith("resharded"):
            print(f"  resharded 2 -> 1 rounds: lockstep {', '.join(f'{x:.2f}' for x in loads['lockstep'])} s; "
                  f"DCP {', '.join(f'{x:.2f}' for x in loads['dcp'])} s; target lockstep <= 1.0x DCP: "
                  f"{'MET' if a <= b else 'NOT MET'}")
    prof = s.get("profile")
    if prof:
        p0 = prof[0]
        worst = max(prof, key=lambda p: p["slots_s"] + p["save_s"])
        print(f"\nprofiled lockstep save (cProfile on; slower rank): slots {worst['slots_s'] * 1e3:.1f} ms, "
              f"save() {worst['save_s'] * 1e3:.1f} ms; the staging copy alone (no profiler) "
              f"{max(p['copy_only_s'] for p in prof) * 1e3:.1f} ms for {p0['staged_bytes'] / 1e6:.0f} MB "
              f"({p0['staged_bytes'] / 1e9 / max(p0['copy_only_s'], 1e-9):.1f} GB/s on rank 0)")
        print("rank 0 cProfile (cumulative):")
        print("\n".join(line for line in p0["cprofile"].splitlines()[:40] if line.strip()))


if __name__ == "__main__":
    main()
