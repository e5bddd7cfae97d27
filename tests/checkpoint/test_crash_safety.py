"""Crash safety: kill -9 during saves, repeatedly, and the previous checkpoint still loads and resumes.

A ~120 MB state (model + AdamW, written as 16 MB shards) is saved every step, so a save is in
flight most of the time. Each round waits until a save is visibly in progress (a ``.partial``
staging directory exists), sleeps a random few milliseconds, and SIGKILLs: the trainer alone
(its writer must notice and exit), the whole process group (trainer, writer and resource tracker
at once: nothing is left to clean up), or the writer alone (the trainer must replace it and go
on). After every kill the newest complete checkpoint must read back with every checksum
verified, and the next round resumes from it.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lockstep.checkpoint import LocalStorage
from lockstep.checkpoint.checkpointer import latest_step
from lockstep.checkpoint.reader import read_full_state
from lockstep.checkpoint.shm import PREFIX, SHM_DIR
from lockstep.checkpoint.writer import complete_steps

ARGS = ["--recipe", "debug", "--transform", "width=512", "--transform", "layers=2", "--checkpoint-every", "1",
        "--checkpoint.max-file-mb", "16", "--checkpoint.keep", "2", "--output.no-progress",
        "--output.sample-tokens", "0", "--output.no-parity-check", "--validation.every", "1000"]


def _start(run: Path, steps: int, resume: bool, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lockstep.cli", "train", *ARGS, "--steps", str(steps), "--run-dir", str(run)]
    if resume:
        cmd.append("--resume")
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def _partials(ckpts: Path) -> set[tuple[str, int]]:
    found = set()
    try:
        for p in ckpts.iterdir():
            if p.name.endswith(".partial"):
                found.add((p.name, p.stat().st_ino))
    except FileNotFoundError:  # not created yet, or renamed while we looked
        pass
    return found


def _wait_for_save_in_flight(proc: subprocess.Popen, ckpts: Path, log: Path, after_step: int,
                             old: set[tuple[str, int]]) -> None:
    """Until a save newer than ``after_step`` is being written by this trainer: a .partial dir not
    among ``old`` (those a killed run left behind, which the new run deletes)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"trainer exited early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        if any(int(name.split("-")[1].split(".")[0]) > after_step for name, _ in _partials(ckpts) - old):
            return
        time.sleep(0.002)
    raise AssertionError(f"no save started within 120 s:\n{log.read_text()[-3000:]}")


def _writer_of(proc: subprocess.Popen) -> psutil.Process:
    children = [c for c in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
    assert len(children) == 1, [c.cmdline() for c in children]
    return children[0]


def _our_segments(pids: set[int]) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and int(n.split("-")[3]) in pids]


def _check_loadable(storage: LocalStorage, expected_at_least: int) -> int:
    step = latest_step(storage)
    assert step is not None and step >= expected_at_least
    got_step, tensors, meta = read_full_state(storage, step)  # every shard's sha256 verified
    assert got_step == step and any(n.startswith("optimizer/") for n in tensors) and meta["family"] == "llama3"
    return step


@pytest.mark.slow
def test_kill_9_during_saves_never_loses_the_previous_checkpoint(tmp_path):
    started: list[subprocess.Popen] = []
    try:
        _kill_rounds(tmp_path, started)
    finally:  # a failed assertion must not leave a trainer saving every step for hours
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _kill_rounds(tmp_path, started):
    rng = random.Random(20261203)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    storage = LocalStorage(str(ckpts))
    pids: set[int] = set()
    last, previous_victim, previous_pid = 0, None, None
    # the trainer alone, the whole group, the writer alone; twice over
    for round_, victim in enumerate(["trainer", "group", "writer", "trainer", "group", "writer"]):
        log = tmp_path / f"round{round_}.log"
        left_behind = _partials(ckpts)
        proc = _start(run, 10_000, resume=round_ > 0, log=log)
        started.append(proc)
        pids.add(proc.pid)
        _wait_for_save_in_flight(proc, ckpts, log, after_step=last, old=left_behind)
        if round_ > 0:
            text = log.read_text()
            assert f"from the step {last} checkpoint" in text
            # after a group kill no tracker was left to free the staging buffer: the next Checkpointer
            # (this run's, or a concurrent test's) does
            if previous_victim == "group":
                assert not _our_segments({previous_pid}), "a group-killed run's staging buffer was not freed"
        time.sleep(rng.uniform(0.0, 0.08))
        writer = _writer_of(proc)
        if victim == "writer":
            writer.kill()
            in_flight = _partials(ckpts)
            # the trainer carries on with a new writer: a later save completes and another starts
            _wait_for_save_in_flight(proc, ckpts, log, after_step=max(complete_steps(storage) or [0]) + 1,
                                     old=in_flight)
            replacement = _writer_of(proc)
            assert replacement.pid != writer.pid
            writer = replacement
            proc.kill()
        elif victim == "trainer":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        psutil.wait_procs([writer], timeout=30)
        assert not writer.is_running(), "the writer outlived its trainer"
        last = _check_loadable(storage, last)
        previous_victim, previous_pid = victim, proc.pid

    # a final run to completion after the last kill: resumes, finishes, and frees every staging buffer
    log = tmp_path / "final.log"
    final_steps = last + 3
    proc = _start(run, final_steps, resume=True, log=log)
    started.append(proc)
    pids.add(proc.pid)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"from the step {last} checkpoint" in text
    assert _check_loadable(storage, final_steps) == final_steps
    assert not list(ckpts.glob("*.partial"))
    assert not _our_segments(pids), "a staging buffer leaked in /dev/shm"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["step"] for r in records if "loss" in r]
    assert losses == list(range(1, final_steps + 1)), "records lost or duplicated across the resumes"
