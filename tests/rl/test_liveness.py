"""RL liveness (issue #15): real ``lockstep rl`` jobs under torchrun (rl-debug, gloo) where a generator is
stopped (SIGSTOP) or killed (kill -9), or the trainer is stopped: the survivor reports the lost rank and
its last phase within ``liveness.timeout_s`` + slack, a stopped run exits non-zero with its newest
checkpoint intact and resumable, and ``on_generator_loss="continue"`` finishes with the generator left.

Every job runs in a session of its own; its processes (torchrun's workers start sessions of their own)
are tracked from the start and SIGKILLed in a ``finally``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lockstep.cli_rl import resolve_rl_config
from lockstep.config.base import ConfigError
from lockstep.observe import read_metrics
from lockstep.rl.layout import StepPlan
from lockstep.rl.liveness import PeerLost, TrainerLiveness

TIMEOUT = 6  # liveness.timeout_s of these jobs
SLACK = 15  # seconds beyond the timeout allowed for a report (a loaded 2-vCPU machine)
PHASE = r"(generating batch \d+ with weights version \d+|receiving weights version \d+( for batch \d+)?|sending .*)"


class Job:
    """``lockstep rl --recipe rl-debug`` in a session of its own, with its processes tracked."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "job.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lockstep.cli", "rl", "--recipe", "rl-debug", "--run-dir", str(self.run_dir),
                 "--liveness.timeout-s", str(TIMEOUT), "--checkpoint.every", "1", *flags],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pids: set[int] = {self.proc.pid}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _track(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        todo = list(self.pids)
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in self.pids:
                    self.pids.add(child)
                    todo.append(child)

    def rank_pid(self, rank: int) -> int:
        """The pid of torchrun worker ``rank`` (waits for it to start)."""
        def find() -> int | None:
            self._track()
            matches = {}
            for pid in self.pids:
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID=" in b"".join(environ):
                    matches[pid] = ppid
            # The worker's own children (the async checkpoint writer, multiprocessing's resource tracker)
            # inherit its environment: the worker is the match whose parent is not a match.
            workers = [pid for pid, ppid in matches.items() if ppid not in matches]
            return workers[0] if len(workers) == 1 else None
        return wait_for(find, 120, f"worker rank {rank}")

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [r for r in read_metrics(path) if "reward/mean" in r] if path.exists() else []

    def wait_steps(self, n: int) -> None:
        wait_for(lambda: (self._track(), len(self.steps()) >= n)[1], 180, f"{n} steps")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self._track()
        for pid in self.pids:
            try:
                if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(timeout=30)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def gone(pid: int) -> bool:
    """The process exited (a zombie its parent has not reaped yet counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def resume_colocated(run_dir: Path, step: int) -> list[dict]:
    """Continue the run from its newest checkpoint (``step``) for one step, in this process."""
    from lockstep.rl.loop import run_rl

    config, _ = resolve_rl_config(["--recipe", "rl-debug", "--run-dir", str(run_dir), "--resume", "--steps",
                                   str(step + 1), "--workers.generators", "0", "--checkpoint.every", "1",
                                   "--checkpoint.mode", "sync"])
    result = run_rl(config)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["resumed"]["from_step"] == step
    return result.steps


def check_stopped_run(job: Job, kind: str) -> None:
    """The trainer's stop: exit status 3, one generator_lost record, the newest checkpoint resumes."""
    text = job.text()
    match = re.search(r"run stopped after step (\d+); newest checkpoint: step (\d+) \(continue with --resume", text)
    assert match, text[-3000:]
    done, newest = int(match[1]), int(match[2])
    assert re.search(r"exitcode\s*:\s*3", text), text[-3000:]  # torchrun names the trainer's status
    records = read_metrics(job.run_dir / "metrics.jsonl")
    lost = [r for r in records if r.get("event") == "generator_lost"]
    assert len(lost) == 1 and lost[0]["generator_lost/rank"] == 1 and lost[0]["generator_lost/kind"] == kind
    assert lost[0]["generator_lost/action"] == "stop" and lost[0]["checkpoint/newest"] == newest
    assert re.fullmatch(PHASE, lost[0]["generator_lost/phase"]), lost[0]
    # a checkpoint every step; torchrun's SIGTERM (kill -9 case) also reaches the background checkpoint
    # writer, so the save of the last step may be lost: then the newest is an earlier one
    assert 1 <= newest <= done
    resumed = resume_colocated(job.run_dir, newest)
    assert [r["step"] for r in resumed] == [newest + 1]


@pytest.mark.slow
def test_stopped_generator_stops_the_run_with_its_rank_and_phase(tmp_path):
    job = Job(tmp_path, "--steps", "300")
    try:
        generator = job.rank_pid(1)
        job.wait_steps(2)
        os.kill(generator, signal.SIGSTOP)
        stopped = time.monotonic()
        line = wait_for(lambda: re.search(rf"lockstep rl: generator rank 1 stalled \(no heartbeat for [\d.]+ s, "
                                          rf"liveness.timeout_s={TIMEOUT}\) while {PHASE}; stopping the run",
                                          job.text()), TIMEOUT + SLACK, "the stall report")
        assert time.monotonic() - stopped >= TIMEOUT - 1.5, line[0]  # no heartbeat for timeout_s (beats 1 s apart)
        trainer = job.rank_pid(0)
        wait_for(lambda: gone(trainer), 60, "the trainer to exit")
        os.kill(generator, signal.SIGCONT)  # it takes torchrun's SIGTERM (pending while stopped) and the job ends
        assert job.wait_exit(60) != 0
        check_stopped_run(job, "stalled")
    finally:
        job.kill()


@pytest.mark.slow
def test_killed_generator_stops_the_run_with_its_rank_and_phase(tmp_path):
    job = Job(tmp_path, "--steps", "300")
    try:
        generator = job.rank_pid(1)
        job.wait_steps(2)
        os.kill(generator, signal.SIGKILL)
        wait_for(lambda: re.search(rf"lockstep rl: generator rank 1 died \(its connection closed\) while {PHASE}; "
                                   "stopping the run", job.text()), SLACK, "the death report")
        assert job.wait_exit(60) != 0  # torchrun ends the job when a worker dies; the trainer stops cleanly first
        check_stopped_run(job, "died")
    finally:
        job.kill()


@pytest.mark.slow
def test_continue_finishes_with_the_generator_left(tmp_path):
    steps = 24
    job = Job(tmp_path, "--steps", str(steps), "--workers.generators", "2", "--liveness.on-generator-loss", "continue")
    try:
        lost = job.rank_pid(2)
        job.wait_steps(2)
        os.kill(lost, signal.SIGSTOP)
        wait_for(lambda: re.search(rf"generator rank 2 stalled \(.*\) while {PHASE}; continuing with generator "
                                   r"rank\(s\) 1 \(liveness.on_generator_loss=continue\)", job.text()),
                 TIMEOUT + SLACK, "the stall report")
        trainer = job.rank_pid(0)
        wait_for(lambda: gone(trainer), 120, "the trainer to finish")
        records = read_metrics(job.run_dir / "metrics.jsonl")
        steps_done = [r for r in records if "reward/mean" in r]
        assert [r["step"] for r in steps_done] == list(range(1, steps + 1))  # every batch trained, none twice
        event = next(r for r in records if r.get("event") == "generator_lost")
        assert event["generator_lost/rank"] == 2 and event["generator_lost/action"] == "continue"
        assert event["generators_left"] == [1]
        after = [r for r in steps_done if r["step"] >= event["generator_lost/reassigned_from_step"]]
        assert after and all(r["generator/rank"] == 1 for r in after)
        assert all(r["policy_lag/max"] == 0 for r in steps_done)  # max_offpolicy_steps=0 still holds
        assert (job.run_dir / "model.safetensors").exists()
        os.kill(lost, signal.SIGCONT)  # it reads that it was dropped and exits 0: the job ends, a success
        assert job.wait_exit(60) == 0, job.text()[-3000:]
        assert "generator rank 2: dropped by the trainer" in job.text()
    finally:
        job.kill()


@pytest.mark.slow
def test_generator_leaves_when_the_trainer_stalls(tmp_path):
    job = Job(tmp_path, "--steps", "300")
    try:
        trainer, generator = job.rank_pid(0), job.rank_pid(1)
        job.wait_steps(2)
        os.kill(trainer, signal.SIGSTOP)
        wait_for(lambda: re.search(r"lockstep rl: generator rank 1: the trainer \(rank 0\) stalled \(no heartbeat "
                                   rf"for [\d.]+ s, liveness.timeout_s={TIMEOUT}\) while .+; exiting", job.text()),
                 TIMEOUT + SLACK, "the generator's report")
        wait_for(lambda: gone(generator), 10, "the generator to exit")
    finally:
        job.kill()


@pytest.mark.parametrize("flag, value, message", [
    ("--liveness.timeout-s", "0", "liveness.timeout_s: must be a finite number > 0"),
    ("--liveness.timeout-s", "-5", "liveness.timeout_s: must be a finite number > 0"),
    ("--liveness.timeout-s", "inf", "liveness.timeout_s"),
    ("--liveness.timeout-s", "nan", "liveness.timeout_s"),
    ("--liveness.on-generator-loss", "retry", "liveness.on_generator_loss: must be one of"),
])
def test_liveness_config_is_validated(flag, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_rl_config(["--recipe", "rl-debug", flag, value])


def test_liveness_fields_are_cli_settable():
    config, _ = resolve_rl_config(["--recipe", "rl-debug", "--liveness.timeout-s", "7.5",
                                   "--liveness.on-generator-loss", "continue"])
    assert config.liveness.timeout_s == 7.5 and config.liveness.on_generator_loss == "continue"


def test_step_plan_reassigns_a_lost_generators_batches():
    plan = StepPlan(3)
    assert [plan.owner(i) for i in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    plan.drop(1, 5)  # generator 1 lost while the trainer waits for step 5
    assert [plan.owner(i) for i in range(1, 5)] == [0, 1, 2, 0]  # received already: unchanged
    assert plan.alive == [0, 2]
    owners = [plan.owner(i) for i in range(5, 13)]
    assert owners == [0, 2, 0, 2, 2, 0, 0, 2]  # 6, 7, 9, 10, 12 keep theirs; 5, 8, 11 go to (i - 1) % 2 of [0, 2]
    assert plan.steps_of(2, 4, 12) == [i for i in range(5, 13) if plan.owner(i) == 2]
    plan.drop(0, 9)
    assert all(plan.owner(i) == 2 for i in range(9, 20)) and plan.alive == [2]


def _fake_generator(port: int, rank: int, phase: str) -> socket.socket:
    """A generator's end of the channel that says hello and its phase once, then falls silent."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall((json.dumps({"hello": rank}) + "\n" + json.dumps({"beat": phase}) + "\n").encode())
    return sock


@pytest.mark.parametrize("fault", ["stalled", "died"])
def test_trainer_end_reports_a_silent_or_closed_generator(fault, capfd):
    """The channel alone (no process group): a generator silent for timeout_s is stalled, one whose
    connection closes died; the watched wait raises PeerLost naming rank and phase."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    box = {}
    connect = threading.Thread(target=lambda: box.setdefault("sock", _fake_generator(port, 4, "generating batch 7")))
    connect.start()
    live = TrainerLiveness(0.5, "stop", [4], listener)
    connect.join()
    try:
        time.sleep(0.2)
        live.check()  # heard from it just now: not lost
        if fault == "died":
            box["sock"].close()
        started = time.monotonic()
        with pytest.raises(PeerLost) as err:
            live.wait([4], lambda: False)
        elapsed = time.monotonic() - started
        assert err.value.rank == 4 and err.value.loss.kind == fault
        assert err.value.loss.phase == "generating batch 7"
        assert elapsed < (0.3 if fault == "died" else 1.5)  # a closed connection is seen at once
        out = capfd.readouterr().err
        assert f"lockstep rl: generator rank 4 {fault} (" in out and "while generating batch 7; stopping the run" in out
    finally:
        live.close()
        if "sock" in box:
            box["sock"].close()


def test_a_loss_in_an_earlier_in_process_run_does_not_end_the_next_one(tmp_path, monkeypatch):
    """The lost-peer flag is per run: left set (by an earlier run or test in this process), it made the next
    in-process ``lockstep rl`` leave through os._exit, killing the caller (a pytest worker)."""
    from lockstep.cli import main
    from lockstep.rl.heartbeat import mark_lost, peer_lost, reset_lost

    def no_exit(code):
        raise AssertionError(f"lockstep rl left the process through os._exit({code})")

    monkeypatch.setattr(os, "_exit", no_exit)
    mark_lost()
    try:
        assert main(["rl", "--recipe", "rl-debug", "--run-dir", str(tmp_path / "rl"), "--steps", "1",
                     "--workers.generators", "0", "--output.no-progress", "--output.no-save-weights"]) == 0
        assert not peer_lost()
    finally:
        reset_lost()
