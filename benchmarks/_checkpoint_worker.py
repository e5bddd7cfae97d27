"""Worker of ``benchmarks/checkpoint.py`` (run that, not this).

``sharded`` phase (torchrun, 2 ranks, gloo): an FSDP2 llama3 model + AdamW state after one step;
rounds of saves by lockstep's Checkpointer (process mode) and by torch.distributed.checkpoint
(``save``, ``async_save`` thread / process / process with a cached shared-memory stager), in
rotating order; then same-layout loads of each, verified bitwise. ``reshard`` phase (one process,
no process group): the 2-rank checkpoints loaded into an unsharded model + AdamW, verified bitwise
against the full tensors the sharded phase gathered.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from lockstep.checkpoint import Checkpointer, LocalStorage
from lockstep.checkpoint.train_state import ensure_optimizer_state, model_slots, optimizer_slots
from lockstep.models.registry import model_config

SIZES = {  # model fp32 + AdamW exp_avg + exp_avg_sq = 12 bytes/parameter
    "full": ("small", {}),  # llama3 small: 29.4M params, 352 MB of state
    "quick": ("tiny", {"n_layers": 2}),  # ~3.7M params, ~45 MB
}

SAVE_VARIANTS = ["lockstep", "dcp_sync", "dcp_async_thread", "dcp_async_process", "dcp_async_process_shm",
                 "tckpt_async"]
#: the async methods timed inside a training loop (a save after every step)
LOOP_VARIANTS = ["lockstep", "dcp_async_thread", "dcp_async_process_shm", "tckpt_async"]


def tckpt_manager():
    """torch-checkpointing's CheckpointManager as its docs set it up for async saves, with what needs
    CUDA turned off: no pinned memory, no non-blocking copies (the brief of issue #15); O_DIRECT off
    (ext4 rejects its unaligned torch.save writes with EINVAL). No resharder: declaring one makes
    the save all-reduce its metadata on a CUDA tensor (metadata_manager.py, device="cuda"), which a
    CPU build cannot do, so its checkpoints load back into the same layout only."""
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
    return CheckpointManager(CheckpointManager.Config(
        items={"model": ItemSpec(), "optim": ItemSpec()},
        save=AsyncCheckpointSaverConfig(staging_config=staging),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def available_variants(names: list[str]) -> list[str]:
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        print("torch-checkpointing is not installed (pip install -c constraints.txt -e '.[bench]'): "
              "its rows are skipped", file=sys.stderr)
        return [v for v in names if v != "tckpt_async"]
    return names


def build(size: str, sharded: bool, seed: int = 0):
    flavor, changes = SIZES[size]
    cfg = dataclasses.replace(model_config("llama3", flavor), **changes)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_weights(seed)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return cfg, model, optimizer


def train_one_step(cfg, model, optimizer) -> None:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=g)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lockstep_slots(model, optimizer) -> dict:
    """What the Trainer builds for every save (lockstep/train/checkpointing.py)."""
    return {**model_slots(model), **optimizer_slots(model, optimizer)}


def local_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's live state tensors (local shards), by lockstep slot name."""
    return {n: s.tensor for n, s in lockstep_slots(model, optimizer).items()}


def poison(model, optimizer) -> None:
    """Overwrite every state tensor so a load that skips one is caught by the comparison."""
    with torch.no_grad():
        for t in local_tensors(model, optimizer).values():
            t.fill_(float("nan") if t.is_floating_point() else -1)


def verify(what: str, live: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    if live.keys() != expected.keys():
        raise SystemExit(f"VERIFY FAILED ({what}): names differ: {sorted(set(live) ^ set(expected))[:5]}")
    bad = [n for n in expected if not torch.equal(live[n], expected[n])]
    if bad:
        raise SystemExit(f"VERIFY FAILED ({what}): {len(bad)} tensors not bitwise equal, e.g. {bad[:3]}")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- sharded phase -------------------------------------------------------------------------------

class Saver:
    """One save method; ``save`` returns (blocking_s, durable_s, extra) on this rank."""

    def __init__(self, kind: str, root: Path, rank: int, world: int, model, optimizer, ckpt_pg) -> None:
        self.kind, self.root, self.rank, self.world = kind, root / kind, rank, world
        self.model, self.optimizer, self.pg = model, optimizer, ckpt_pg
        self.checkpointer = None
        self.stager = None
        self.manager = None
        self.pending = None  # the in-flight async save's future (DCP, torch-checkpointing)
        if kind == "tckpt_async":
            self.manager = tckpt_manager()  # spawns its writer process now, as a trainer would at start-up
        if kind == "lockstep":
            self.checkpointer = Checkpointer(LocalStorage(self.root), rank=rank, world_size=world, keep=0,
                                             mode="process")
        if kind == "dcp_async_process_shm":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # DCP's own best CPU setting: staging copies cached (reused across saves) in shared
            # memory, so the daemon process receives handles rather than a pickled copy
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                       use_async_staging=False, use_non_blocking_copy=False))

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"  # lockstep's step directory; DCP's checkpoint_id

    def save(self, step: int) -> tuple[float, float, dict]:
        t0 = time.perf_counter()
        blocking, extra = self.start(step)
        self.finish(extra)
        return blocking, time.perf_counter() - t0, extra

    def start(self, step: int) -> tuple[float, dict]:
        """What the training loop calls: returns (blocking seconds, extra); the save may go on after."""
        extra: dict = {}
        if self.kind == "lockstep":
            t0 = time.perf_counter()
            slots = lockstep_slots(self.model, self.optimizer)
            t_slots = time.perf_counter()
            stats = self.checkpointer.save(step, slots, {"rank": self.rank}, {"world_size": self.world})
            extra = {"slots_s": t_slots - t0, "inside_save_ms": stats.blocking_ms, "waited_ms": stats.waited_ms}
            return time.perf_counter() - t0, extra
        ckpt_id = str(self.path(step))
        t0 = time.perf_counter()
        if self.pending is not None:  # one save in flight at a time, as lockstep's save waits for its previous
            self.pending.result()
            self.pending = None
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        extra["state_dict_s"] = time.perf_counter() - t0
        if self.kind == "dcp_sync":
            dcp.save(state, checkpoint_id=ckpt_id, process_group=self.pg)
            return time.perf_counter() - t0, extra
        if self.kind == "tckpt_async":
            self.pending = self.manager.save(ckpt_id, state)
            return time.perf_counter() - t0, extra
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kwargs = {"async_checkpointer_type": AsyncCheckpointerType.THREAD if self.kind == "dcp_async_thread"
                  else AsyncCheckpointerType.PROCESS}
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        future = dcp.async_save(state, checkpoint_id=ckpt_id, process_group=self.pg, **kwargs)
        self.pending = getattr(future, "upload_completion", future)
        return time.perf_counter() - t0, extra

    def finish(self, extra: dict | None = None) -> None:
        """Wait until the last started save is durable and visible."""
        if self.kind == "lockstep":
            done = self.checkpointer.wait()  # every save finished since the last wait
            if not done or any(d.error for d in done):
                raise SystemExit(f"lockstep save failed: {done}")
            if extra is not None:
                extra.update(write_s=done[-1].write_s, bytes=done[-1].bytes)
        elif self.pending is not None:
            self.pending.result()
            self.pending = None

    def load(self, step: int) -> None:
        """Same-layout load of this method's save ``step`` into the live model and optimizer."""
        if self.kind == "lockstep":
            self.checkpointer.load(lockstep_slots(self.model, self.optimizer), step)
            return
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.kind == "tckpt_async":
            state = dict(self.manager.load(str(self.path(step)), into=state))
        else:
            dcp.load(state, checkpoint_id=str(self.path(step)), process_group=self.pg)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.stager is not None:
            self.stager.close()


def settle(rank: int, seconds: float) -> None:
    """No write of one measurement overlaps the next: flush dirty pages, pause, line up the ranks."""
    dist.barrier()
    if rank == 0:
        os.sync()
    time.sleep(seconds)
    dist.barrier()


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def drop_caches(rank: int, enabled: bool) -> None:
    dist.barrier()
    if enabled and rank == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    dist.barrier()


def sharded_phase(args) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root)
    ckpt_pg = dist.new_group(backend="gloo")  # DCP's collectives off the training group, as a trainer would
    cfg, model, optimizer = build(args.size, sharded=True)
    train_one_step(cfg, model, optimizer)
    ensure_optimizer_state(optimizer)
    reference = {n: t.clone() for n, t in local_tensors(model, optimizer).items()}
    params = sum(p.numel() for p in model.parameters())  # global numel of the DTensors
    state_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    total_state_bytes = sum(gather(state_bytes))

    # full (unsharded) tensors for the 1-process resharding check
    full = {}
    sd_model = model.state_dict()
    for name, t in sd_model.items():
        full[f"model/{name}"] = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    fqn = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in optimizer.state[p].items():
                full[f"optimizer/{fqn[id(p)]}/{key}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    if rank == 0:
        torch.save(full, root / "reference_full.pt")
    del full

    variants = available_variants([v for v in SAVE_VARIANTS if v in args.variants])
    savers = {v: Saver(v, root, rank, world, model, optimizer, ckpt_pg) for v in variants}
    time.sleep(2.0)  # lockstep's writer processes finish starting (the Trainer builds its Checkpointer at start-up)
    results: dict[str, list] = {v: [] for v in variants}
    first: dict[str, dict] = {}
    step = 0
    for rnd in range(args.rounds + 1):  # round 0: first saves (shared memory, daemons), reported apart
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for v in order:
            step += 1
            settle(rank, args.settle)
            blocking, durable, extra = savers[v].save(step)
            per_rank = gather({"blocking_s": blocking, "durable_s": durable, **extra})
            record = {"step": step, "blocking_s": max(r["blocking_s"] for r in per_rank),
                      "durable_s": max(r["durable_s"] for r in per_rank), "per_rank": per_rank}
            if rnd == 0:
                first[v] = record
            else:
                results[v].append(record)
            if rank == 0:
                prev = savers[v].last_step if hasattr(savers[v], "last_step") else None
                if prev is not None:  # keep one save per method on disk (outside the timed region)
                    shutil.rmtree(savers[v].path(prev), ignore_errors=True)
            savers[v].last_step = step
            if rank == 0:
                print(f"  round {rnd} {v:<22} blocking {record['blocking_s'] * 1e3:9.1f} ms  "
                      f"durable {record['durable_s']:7.2f} s", flush=True)

    profile = None
    if args.profile:  # one more lockstep save under cProfile (rank 0's trainer side)
        settle(rank, args.settle)
        step += 1
        prof = cProfile.Profile()
        prof.enable()
        t0 = time.perf_counter()
        slots = lockstep_slots(model, optimizer)
        t1 = time.perf_counter()
        savers["lockstep"].checkpointer.save(step, slots, {"rank": rank}, {"world_size": world})
        t2 = time.perf_counter()
        prof.disable()
        savers["lockstep"].checkpointer.wait()
        if rank == 0:
            shutil.rmtree(savers["lockstep"].path(step), ignore_errors=True)
        # the copy alone, into the same (warm) staging views, as save() does it
        views = savers["lockstep"].checkpointer._views
        t3 = time.perf_counter()
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(slots[name].tensor.detach().reshape(view.shape))
        copy_s = time.perf_counter() - t3
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(18)
        profile = {"slots_s": t1 - t0, "save_s": t2 - t1, "copy_only_s": copy_s,
                   "staged_bytes": sum(v.numel() * v.element_size() for v in views.values()),
                   "cprofile": text.getvalue() if rank == 0 else ""}
        profile = gather(profile)

    dirs = {v: savers[v].path(savers[v].last_step) for v in variants}
    sizes = {v: dir_bytes(d) for v, d in dirs.items()} if rank == 0 else {}

    # -- same-layout loads, verified bitwise --
    # lockstep, DCP (dcp_sync's checkpoint) and torch-checkpointing, rotating order
    load_from = {who: v for who, v in (("lockstep", "lockstep"), ("dcp", "dcp_sync"), ("tckpt", "tckpt_async"))
                 if v in dirs}
    loads: dict[str, list[float]] = {who: [] for who in load_from}
    for rnd in range(args.load_rounds):
        order = list(load_from)[rnd % len(load_from):] + list(load_from)[:rnd % len(load_from)]
        for who in order:
            poison(model, optimizer)
            drop_caches(rank, args.drop_caches)
            t0 = time.perf_counter()
            savers[load_from[who]].load(savers[load_from[who]].last_step)
            seconds = max(gather(time.perf_counter() - t0))
            verify(f"{who} same-layout load", local_tensors(model, optimizer), reference)
            loads[who].append(seconds)
            if rank == 0:
                print(f"  load round {rnd} {who:<9} {seconds:6.2f} s  (bitwise equal)", flush=True)
    # every DCP variant's checkpoint holds the same state: load and verify each once
    for v, d in dirs.items():
        if v in load_from.values():
            continue
        poison(model, optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(d), process_group=ckpt_pg)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        verify(f"{v} same-layout load", local_tensors(model, optimizer), reference)
    if rank == 0:
        print("  every checkpoint loads back bitwise equal (same layout)", flush=True)

    loop = training_loop(savers, cfg, model, optimizer, rank, args) if args.loop_steps else {}

    for s in savers.values():
        s.close()
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape

        if ape._CHECKPOINT_PROCESS is not None:
            ape._CHECKPOINT_PROCESS.__del__()  # TERMINATE + join the DCP daemon (os._exit skips atexit)
            ape._CHECKPOINT_PROCESS = None
    except Exception as err:  # only cleanup
        print(f"rank {rank}: DCP daemon cleanup: {err}", file=sys.stderr)
    if rank == 0:
        out = {"size": args.size, "flavor": SIZES[args.size], "params": params, "state_bytes": total_state_bytes,
               "world": world, "first": first, "rounds": results, "loads": loads, "dir_bytes": sizes,
               "dirs": {v: str(d) for v, d in dirs.items()}, "lockstep_step": savers.get("lockstep") and
               savers["lockstep"].last_step, "loop": loop, "profile": profile, "torch": torch.__version__}
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def training_loop(savers: dict, cfg, model, optimizer, rank: int, args) -> dict:
    """Train with a save after every step, per async method, and without saves: each iteration's
    time (the step, then the save call, which waits for the previous save if it is still going)
    and the step's compute alone, which is what a background writer slows down. Several passes,
    the order of methods reversed every other pass (a shared host's load drifts); every rank runs
    the same steps (FSDP keeps them in lockstep), the slower rank's times count."""
    methods = ["none", *(v for v in LOOP_VARIANTS if v in savers)]
    times: dict[str, dict[str, list[float]]] = {m: {"iter_s": [], "step_s": []} for m in methods}
    step = 10_000
    for pass_ in range(args.loop_passes):
        for m in (methods if pass_ % 2 == 0 else methods[::-1]):
            saver = savers.get(m)
            settle(rank, args.settle)
            for i in range(args.loop_steps):
                step += 1
                t0 = time.perf_counter()
                train_one_step(cfg, model, optimizer)
                t1 = time.perf_counter()
                if saver is not None:
                    saver.start(step)
                t2 = time.perf_counter()
                if rank == 0 and saver is not None:  # the save two back is finished: keep the disk from filling
                    shutil.rmtree(saver.path(step - 2), ignore_errors=True)
                if i >= 2:  # the first two: the previous method's leftovers, warm-up
                    per_rank = gather((t2 - t0, t1 - t0))
                    times[m]["iter_s"].append(max(r[0] for r in per_rank))
                    times[m]["step_s"].append(max(r[1] for r in per_rank))
            if saver is not None:
                saver.finish()
                if rank == 0:
                    for s in (step - 1, step):
                        shutil.rmtree(saver.path(s), ignore_errors=True)
            if rank == 0:
                print(f"  training loop pass {pass_} {m:<22} iteration "
                      f"{statistics.median(times[m]['iter_s'][-(args.loop_steps - 2):]):6.2f} s  step compute "
                      f"{statistics.median(times[m]['step_s'][-(args.loop_steps - 2):]):6.2f} s", flush=True)
    return times


# -- resharded phase (one process) ---------------------------------------------------------------

def reshard_phase(args) -> None:
    sharded = json.loads(Path(args.sharded_json).read_text())
    root = Path(args.root)
    reference = torch.load(root / "reference_full.pt")
    cfg, model, optimizer = build(args.size, sharded=False)
    ensure_optimizer_state(optimizer)
    dcp_dir = sharded["dirs"].get("dcp_sync") or next(d for v, d in sharded["dirs"].items() if v.startswith("dcp"))
    times: dict[str, list[float]] = {"lockstep": [], "dcp": []}

    def cold() -> None:
        if args.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")

    for rnd in range(args.load_rounds):
        for who in (["lockstep", "dcp"] if rnd % 2 == 0 else ["dcp", "lockstep"]):
            if who == "lockstep" and "lockstep" not in sharded["dirs"]:
                continue
            poison(model, optimizer)
            cold()
            t0 = time.perf_counter()
            if who == "lockstep":
                ck = Checkpointer(LocalStorage(root / "lockstep"), rank=0, world_size=1, mode="sync")
                ck.load(lockstep_slots(model, optimizer), sharded["lockstep_step"])
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=dcp_dir)  # no process group: a one-process load
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            seconds = time.perf_counter() - t0
            verify(f"{who} resharded 2 -> 1 load", local_tensors(model, optimizer), reference)
            times[who].append(seconds)
            print(f"  reshard load round {rnd} {who:<9} {seconds:6.2f} s  (bitwise equal to the full state)",
                  flush=True)
    Path(args.out).write_text(json.dumps({"loads": times}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["sharded", "reshard"])
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--load-rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=1.0)
    p.add_argument("--variants", default=",".join(SAVE_VARIANTS))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--loop-steps", type=int, default=8, help="steps per method in the training loop (0: skip)")
    p.add_argument("--loop-passes", type=int, default=3)
    p.add_argument("--drop-caches", action="store_true")
    p.add_argument("--sharded-json", default="")
    args = p.parse_args()
    args.variants = args.variants.split(",")
    (sharded_phase if args.phase == "sharded" else reshard_phase)(args)


if __name__ == "__main__":
    main()
