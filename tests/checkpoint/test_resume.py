"""Exact resume and resharding load through the trainer (``lockstep train --checkpoint-every / --resume``).

Exact resume is bitwise: the interrupted-and-resumed run's losses (JSON floats round-trip exactly)
and final weights equal the straight run's. Resharding is checked on the state itself: a
checkpoint saved under layout A is loaded under layout B and saved again by B; both checkpoints,
read back unsharded, are bitwise equal tensor by tensor (model and optimizer).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep.checkpoint import LocalStorage
from lockstep.checkpoint.reader import read_full_state

QUIET = ["--output.no-progress", "--output.sample-tokens", "0", "--output.no-parity-check",
         "--validation.every", "2", "--validation.batches", "2"]
WORKER = Path(__file__).with_name("reshard_worker.py")


def _run(args, nproc=1, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lockstep.cli", "train", *args, *QUIET]
    if nproc > 1:  # the torchrun job `--nproc N` would start, without the relaunching process's start-up
        cmd[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _check_exact_resume(tmp_path, recipe, nproc, layout):
    common = ["--recipe", recipe, "--steps", "6", *layout]
    _run([*common, "--run-dir", str(tmp_path / "straight")], nproc)
    _run([*common, "--run-dir", str(tmp_path / "resumed"), "--checkpoint-every", "2", "--stop-after", "3"], nproc)
    # what the crash left: records up to step 3 (+ its checkpoint record); step 3 was saved at the stop
    out = _run([*common, "--run-dir", str(tmp_path / "resumed"), "--checkpoint-every", "2", "--resume"], nproc)
    assert "from the step 3 checkpoint" in out
    straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
    assert [(r["step"], r["loss"]) for r in straight if "loss" in r] == \
        [(r["step"], r["loss"]) for r in resumed if "loss" in r]
    assert [(r["step"], r["val_loss"]) for r in straight if "val_loss" in r] == \
        [(r["step"], r["val_loss"]) for r in resumed if "val_loss" in r]
    saves = [r for r in resumed if "checkpoint/step" in r]
    assert [r["checkpoint/step"] for r in saves] == [2, 3, 4, 6]
    assert all(r["checkpoint/bytes"] > 0 and r["checkpoint/blocking_ms"] > 0 and "checkpoint/error" not in r
               for r in saves)
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert manifest["resumed"]["from_step"] == 3


def test_exact_resume_one_process(tmp_path):
    _check_exact_resume(tmp_path, "debug", 1, [])


@pytest.mark.slow
def test_exact_resume_fsdp_two_ranks(tmp_path):
    _check_exact_resume(tmp_path, "debug", 2, ["--parallel.dp-shard", "2"])


def test_resume_refuses_a_changed_model(tmp_path):
    run = str(tmp_path / "run")
    _run(["--recipe", "debug", "--steps", "2", "--run-dir", run, "--checkpoint-every", "2"])
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "train", "--recipe", "debug-qwen3", "--steps", "4",
                           "--run-dir", run, "--resume", *QUIET], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "config error: resume:" in proc.stderr and "model.family" in proc.stderr


def test_resume_without_a_checkpoint_is_a_config_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "train", "--recipe", "debug", "--run-dir",
                           str(tmp_path / "nothing"), "--resume", *QUIET], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr


def _reshard(src_run, out_dir, recipe, nproc, layout):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), str(out_dir), "--", "--recipe", recipe, "--steps", "3", "--run-dir", str(src_run),
           "--resume", *QUIET, *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _assert_same_state(dir_a, dir_b):
    step_a, a, _ = read_full_state(LocalStorage(dir_a))
    step_b, b, _ = read_full_state(LocalStorage(dir_b))
    assert step_a == step_b and a.keys() == b.keys()
    assert any(k.startswith("optimizer/") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == []


RESHARD = [
    # (id, recipe, saving nproc, saving layout, loading nproc, loading layout)
    ("fsdp2-to-1", "debug", 2, ["--parallel.dp-shard", "2"], 1, []),
    ("1-to-fsdp4", "debug", 1, [], 4, ["--parallel.dp-shard", "4"]),
    ("fsdp2-to-tp2", "debug", 2, ["--parallel.dp-shard", "2"], 2, ["--parallel.dp-shard", "1", "--parallel.tp", "2"]),
    ("tp2-to-fsdp2xtp2", "debug", 2, ["--parallel.dp-shard", "1", "--parallel.tp", "2"], 4,
     ["--parallel.dp-shard", "2", "--parallel.tp", "2"]),
    ("1-to-ep2", "debug-moe", 1, [], 2, ["--parallel.dp-shard", "2", "--parallel.ep", "2"]),
    # MLA (replicated latents), experts split over ep rows and each one's hidden dim over tp, MTP
    ("tp2xep2-to-1 deepseek", "debug-deepseek", 4,
     ["--parallel.dp-shard", "2", "--parallel.ep", "2", "--parallel.tp", "2"], 1, []),
    # EP that borrows: experts split over ep=2 and FSDP-sharded over dp_shard_mod_ep=2, resumed under
    # HSDP x EP (experts replicated over dp_replicate=2), and that under one process
    ("fsdp4xep2-to-hsdp2xep2 moe", "debug-moe", 4, ["--parallel.dp-shard", "4", "--parallel.ep", "2"], 4,
     ["--parallel.dp-replicate", "2", "--parallel.dp-shard", "2", "--parallel.ep", "2"]),
    ("hsdp2xep2-to-1 deepseek", "debug-deepseek", 4,
     ["--parallel.dp-replicate", "2", "--parallel.dp-shard", "2", "--parallel.ep", "2"], 1, []),
    ("fsdp2-to-pp2", "debug", 2, ["--parallel.dp-shard", "2"], 2,
     ["--parallel.dp-shard", "1", "--parallel.pp", "2", "--model.n-layers", "4"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe, n_save, save_layout, n_load, load_layout", RESHARD,
                         ids=[r[0] for r in RESHARD])
def test_resharding_load_is_exact(tmp_path, computed_once, name, recipe, n_save, save_layout, n_load, load_layout):
    shape = ["--model.n-layers", "4"] if "--model.n-layers" in load_layout else []
    args = ["--recipe", recipe, "--steps", "3", "--checkpoint-every", "3", *save_layout, *shape]
    # cases saving under the same layout (fsdp2-to-1, fsdp2-to-tp2) share one saving run, each resuming a copy
    saved = computed_once(f"reshard source {n_save} {' '.join(args)}",
                          lambda d: _run([*args, "--run-dir", str(d / "src")], n_save))
    src = Path(shutil.copytree(saved / "src", tmp_path / "src"))
    _reshard(src, tmp_path / "again", recipe, n_load, load_layout)
    _assert_same_state(src / "checkpoints", tmp_path / "again")


def test_resume_may_change_how_the_step_executes(tmp_path):
    """Execution settings are resumable (``RESUMABLE_CHANGES``): a run checkpointed in eager mode and
    resumed as a captured graph with activation recomputation trains bitwise like the straight run."""
    common = ["--recipe", "debug", "--steps", "4"]
    _run([*common, "--run-dir", str(tmp_path / "straight")])
    _run([*common, "--run-dir", str(tmp_path / "resumed"), "--checkpoint-every", "2", "--stop-after", "2"])
    out = _run([*common, "--run-dir", str(tmp_path / "resumed"), "--checkpoint-every", "2", "--resume",
                "--training.mode", "graph", "--training.activation-checkpoint.mode", "full"])
    assert "from the step 2 checkpoint" in out
    straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
    assert [(r["step"], r["loss"]) for r in straight if "loss" in r] == \
        [(r["step"], r["loss"]) for r in resumed if "loss" in r]
