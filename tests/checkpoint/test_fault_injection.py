"""Fault injection: training that saves every step is killed, frozen and killed, has a checkpoint file
corrupted and its disk filled, at seeded random moments; after each fault it resumes from the newest
checkpoint that verifies, and at the end the run equals an uninterrupted one bitwise while nothing that
held a checkpoint was deleted (issue #15).

Four runs of the debug recipe (a save every step, background writer, keep all) follow each other:
1. a fresh run, stopped by ``kill -9`` of its process group (or SIGSTOP, then ``kill -9``: the order is
   drawn), after which one file of its newest checkpoint is bit-flipped or truncated (bit rot);
2. a resumed run -- it must skip the corrupt checkpoint for the previous one, setting it aside --
   stopped by the other of the two kills;
3. a resumed run on a disk that fills after about one more checkpoint (``fault_worker.py``: the file
   write fails part-way with ENOSPC); it reports each failed save, goes on, and exits 2 because its
   final checkpoint could not be written; no half-written checkpoint is left looking valid;
4. a resumed run to the end, on a disk with room again.
Each resume must name the newest checkpoint that verifies, every checkpoint ever seen complete must
still exist at the end byte for byte (in place, or in ``set-aside/`` for the corrupted one), every
checkpoint left in place must verify, and losses and final weights must equal a straight run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep.checkpoint import CheckpointError, LocalStorage
from lockstep.checkpoint.reader import read_full_state
from lockstep.checkpoint.writer import complete_steps

STEPS = 16
ARGS = ["--recipe", "debug", "--steps", str(STEPS), "--checkpoint-every", "1", "--checkpoint.keep", "0",
        "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0",
        "--output.no-parity-check", "--output.no-tensorboard"]
WORKER = Path(__file__).with_name("fault_worker.py")


def _start(run: Path, log: Path, *extra: str, quota: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if quota is not None:
        env["LOCKSTEP_TEST_DISK_QUOTA"] = str(quota)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(WORKER), "train", *ARGS, "--run-dir", str(run), *extra],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait_for_new_checkpoints(proc, storage, log: Path, count: int) -> None:
    start = len(complete_steps(storage))
    deadline = time.monotonic() + 120
    while len(complete_steps(storage)) < start + count:
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no new checkpoints within 120 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.01)


def _kill(proc, how: str, rng: random.Random) -> None:
    time.sleep(rng.uniform(0.0, 0.1))  # anywhere in a step or a save
    if how == "stop+kill":
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _newest_verifiable(storage: LocalStorage) -> int:
    for step in reversed(complete_steps(storage)):
        try:
            read_full_state(storage, step)  # every file's size and sha256
            return step
        except CheckpointError:
            continue
    raise AssertionError("no checkpoint verifies")


def _contents(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _snapshot(ckpts: Path, seen: list[tuple[str, dict]]) -> None:
    """Record every complete checkpoint's files (each version of a step: none may vanish or change)."""
    for step in complete_steps(LocalStorage(ckpts)):
        name = f"step-{step:08d}"
        if (name, contents := _contents(ckpts / name)) not in seen:
            seen.append((name, contents))


def _damage(step_dir: Path, rng: random.Random) -> str:
    victim = rng.choice(sorted(p for p in step_dir.iterdir() if p.name != "index.json"))
    data = bytearray(victim.read_bytes())
    if rng.random() < 0.5:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        del data[rng.randrange(len(data)):]
    victim.write_bytes(bytes(data))
    return victim.name


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.mark.slow
def test_faults_at_random_moments_resume_bitwise_and_delete_nothing(tmp_path):
    started: list[subprocess.Popen] = []
    try:
        _faults(tmp_path, started)
    finally:  # a failed assertion must not leave a trainer running
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _faults(tmp_path: Path, started: list) -> None:
    rng = random.Random(1515)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    storage = LocalStorage(ckpts)
    seen: list[tuple[str, dict]] = []
    kills = rng.sample(["kill-9", "stop+kill"], 2)
    straight = _start(tmp_path / "straight", tmp_path / "straight.log")  # the reference, alongside
    started.append(straight)

    # 1: fresh run, killed; then bit rot in its newest checkpoint
    proc = _start(run, tmp_path / "run1.log")
    started.append(proc)
    _wait_for_new_checkpoints(proc, storage, tmp_path / "run1.log", rng.randint(2, 4))
    _kill(proc, kills[0], rng)
    newest = complete_steps(storage)[-1]
    damaged = _damage(ckpts / f"step-{newest:08d}", rng)
    _snapshot(ckpts, seen)
    expected = _newest_verifiable(storage)
    assert expected < newest, f"damaging {damaged} of step {newest} went unnoticed"

    # 2: resumes from the checkpoint before the damaged one; killed again
    proc = _start(run, tmp_path / "run2.log", "--resume")
    started.append(proc)
    _wait_for_new_checkpoints(proc, storage, tmp_path / "run2.log", rng.randint(1, 3))
    _kill(proc, kills[1], rng)
    text = (tmp_path / "run2.log").read_text()
    assert f"from the step {expected} checkpoint" in text, text[-3000:]
    assert f"step {newest} failed verification" in text and damaged in text
    _snapshot(ckpts, seen)

    # 3: the disk fills after about one more checkpoint: failed saves are reported, the run exits 2
    expected = _newest_verifiable(storage)
    size = sum(p.stat().st_size for p in (ckpts / f"step-{expected:08d}").iterdir())
    used = sum(p.stat().st_size for p in ckpts.rglob("*") if p.is_file())
    stop = expected + 3
    proc = _start(run, tmp_path / "run3.log", "--resume", "--stop-after", str(stop), quota=used + size * 3 // 2)
    started.append(proc)
    assert proc.wait(timeout=180) == 2
    text = (tmp_path / "run3.log").read_text()
    assert f"from the step {expected} checkpoint" in text, text[-3000:]
    assert "No space left on device (errno 28)" in text
    assert f"lockstep: checkpoint error: the final checkpoint (step {stop}) was not saved" in text.splitlines()[-1]
    assert not list(ckpts.glob("*.partial")), "a failed save's staging directory was left behind"
    assert complete_steps(storage)[-1] < stop
    _snapshot(ckpts, seen)

    # 4: room again: resumes from the newest verifiable checkpoint and runs to the end
    expected = _newest_verifiable(storage)
    proc = _start(run, tmp_path / "run4.log", "--resume")
    started.append(proc)
    assert proc.wait(timeout=180) == 0, (tmp_path / "run4.log").read_text()[-3000:]
    assert f"from the step {expected} checkpoint" in (tmp_path / "run4.log").read_text()
    assert straight.wait(timeout=180) == 0, (tmp_path / "straight.log").read_text()[-3000:]

    # nothing that was ever a complete checkpoint is gone or changed; the damaged one is set aside
    aside = {p.name.split(".")[0]: p for p in (ckpts / "set-aside").iterdir()}
    for name, files in seen:
        copies = [d for d in (ckpts / name, aside.get(name)) if d is not None and d.exists()]
        assert files in [_contents(d) for d in copies], f"{name} was deleted or changed"
    assert set(aside) == {f"step-{newest:08d}"} and ".corrupt-" in aside[f"step-{newest:08d}"].name
    # everything left in place verifies, the run is complete, and it is the straight run, bitwise
    steps = complete_steps(storage)
    assert steps[-1] == STEPS and all(read_full_state(storage, s)[0] == s for s in steps)
    assert not list(ckpts.glob("*.partial"))
    assert _losses(run) == _losses(tmp_path / "straight") and len(_losses(run)) == STEPS
    a, b = load_file(run / "model.safetensors"), load_file(tmp_path / "straight" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
