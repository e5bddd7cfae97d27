"""Filesystem failures are one-line errors naming the path and the operation, never tracebacks, and a
failed write never leaves a file that looks whole (issue #15, item 5).

Permissions: when the tests run as an ordinary user a directory is made unwritable or unreadable with
``chmod``; as root (CI containers, this machine) ``chmod`` stops nothing, so the OS calls that touch
that directory are made to fail with ``PermissionError`` exactly as the kernel would (``deny``). A full
disk is simulated the same way (``ENOSPC`` from the write), in every case below the lockstep code.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
from pathlib import Path

import pytest

from lockstep.checkpoint import LocalStorage
from lockstep.checkpoint.reader import read_full_state
from lockstep.checkpoint.writer import complete_steps
from lockstep.cli import main

pytestmark = pytest.mark.xdist_group("trainer")

QUIET = ["--recipe", "debug", "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0",
         "--output.no-parity-check", "--output.no-tensorboard"]


def _one_line(err: str, *parts: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(p in err for p in parts), err


def _under(path, root: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(root.resolve())
    except (TypeError, ValueError):
        return False


@pytest.fixture
def deny(monkeypatch, request):
    """``deny(path, write_only)``: make ``path`` unwritable (``write_only``) or unreadable as well."""

    def apply(root: Path, write_only: bool) -> None:
        if os.geteuid() != 0:
            root.chmod(0o500 if write_only else 0o000)
            request.addfinalizer(lambda: root.chmod(0o755))
            return

        def refuse(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

        real_open, real_os_open, real_listdir, real_scandir, real_mkdir = \
            builtins.open, os.open, os.listdir, os.scandir, os.mkdir

        def fake_open(file, mode="r", *args, **kwargs):
            if _under(file, root) and (not write_only or any(c in mode for c in "wax+")):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def fake_os_open(path, flags, *args, **kwargs):
            writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if _under(path, root) and (not write_only or writes):
                refuse(path)
            return real_os_open(path, flags, *args, **kwargs)

        def fake_mkdir(path, *args, **kwargs):
            if _under(path, root) and Path(os.fsdecode(path)).resolve() != root.resolve():
                refuse(path)
            return real_mkdir(path, *args, **kwargs)

        def listing(real):
            def fake(path="."):
                if not write_only and _under(path, root):
                    refuse(path)
                return real(path)
            return fake

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(os, "open", fake_os_open)
        monkeypatch.setattr(os, "mkdir", fake_mkdir)
        monkeypatch.setattr(os, "listdir", listing(real_listdir))
        monkeypatch.setattr(os, "scandir", listing(real_scandir))

    return apply


def test_run_dir_that_is_a_file(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("not a run")
    for extra in ([], ["--resume"]):
        assert main(["train", *QUIET, "--steps", "1", "--run-dir", str(file), *extra]) == 1
        _one_line(capsys.readouterr().err, "filesystem error: run_dir:", str(file),
                  "is a file, not a directory (creating the run directory)")
    assert file.read_text() == "not a run"


def test_run_dir_under_a_file(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("not a run")
    assert main(["train", *QUIET, "--steps", "1", "--run-dir", str(file / "runs" / "a")]) == 1
    _one_line(capsys.readouterr().err, f"run_dir: {file / 'runs' / 'a'} lies under {file}, which is a file")


def test_unwritable_run_dir(tmp_path, capsys, deny):
    run = tmp_path / "run"
    run.mkdir()
    deny(run, write_only=True)
    assert main(["train", *QUIET, "--steps", "1", "--run-dir", str(run)]) == 1
    _one_line(capsys.readouterr().err, f"run_dir: {run} is not writable (creating a file in it failed: "
                                       "Permission denied (errno 13))")


def test_unreadable_checkpoint_dir_on_resume(tmp_path, capsys, deny):
    run = tmp_path / "run"
    assert main(["train", *QUIET, "--steps", "2", "--checkpoint-every", "1", "--checkpoint.mode", "sync",
                 "--run-dir", str(run), "--output.no-save-weights"]) == 0
    capsys.readouterr()
    deny(run / "checkpoints", write_only=False)
    assert main(["train", *QUIET, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    _one_line(capsys.readouterr().err, "checkpoint error:", str(run / "checkpoints"),
              "listing checkpoints in", "failed: Permission denied (errno 13)")


def test_unreadable_checkpoint_file_is_an_access_error_not_a_fallback(tmp_path, capsys, deny):
    run = tmp_path / "run"
    assert main(["train", *QUIET, "--steps", "2", "--checkpoint-every", "1", "--checkpoint.mode", "sync",
                 "--run-dir", str(run), "--output.no-save-weights"]) == 0
    capsys.readouterr()
    shard = sorted((run / "checkpoints" / "step-00000002").glob("*.safetensors"))[-1]
    deny(shard, write_only=False)
    assert main(["train", *QUIET, "--steps", "3", "--run-dir", str(run), "--resume"]) == 2
    _one_line(capsys.readouterr().err, f"checkpoint error: {shard}: loading checkpoint step 2 in",
              "failed: Permission denied (errno 13)")
    assert (run / "checkpoints" / "step-00000002" / "index.json").exists()  # not set aside: it is not damaged
    assert not (run / "checkpoints" / "set-aside").exists()


def _disk_full_from(monkeypatch, first_step: int) -> None:
    """Saves of ``first_step`` on fail like a full disk: LocalStorage.put's file write stops part-way with
    ENOSPC (the data handed to it runs out into the error), so its own clean-up path runs."""
    real_put = LocalStorage.put

    def put(self, key, chunks):
        step = key.split("/")[0].removesuffix(".partial")
        if step.startswith("step-") and int(step[5:]) >= first_step:
            def cut():
                yield bytes(chunks[0])[:16]
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_put(self, key, cut())
        return real_put(self, key, chunks)

    monkeypatch.setattr(LocalStorage, "put", put)


def test_disk_full_during_a_save_stops_cleanly_and_leaves_no_false_checkpoint(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    _disk_full_from(monkeypatch, 3)
    assert main(["train", *QUIET, "--steps", "4", "--checkpoint-every", "1", "--checkpoint.mode", "sync",
                 "--run-dir", str(run), "--output.no-save-weights"]) == 2
    _one_line(capsys.readouterr().err, "checkpoint error:", str(run / "checkpoints" / "step-00000003.partial"),
              "writing the checkpoint file failed: No space left on device (errno 28)")
    storage = LocalStorage(run / "checkpoints")
    assert complete_steps(storage) == [1, 2]
    assert all(read_full_state(storage, s)[0] == s for s in (1, 2))  # every checksum verified
    # the failed save's staging is gone (it holds the space the next save needs), nothing half-written left
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_disk_full_writing_the_weights(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    real_open = builtins.open

    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fake_open(file, mode="r", *args, **kwargs):
        if "model.safetensors" in os.fsdecode(file) and "w" in mode:
            real_open(file, mode, *args, **kwargs).close()  # the file exists, as a real open would leave it
            return Full()
        return real_open(file, mode, *args, **kwargs)

    real_fdopen = os.fdopen

    def fake_fdopen(fd, mode="r", *args, **kwargs):  # lockstep.atomic writes through mkstemp's fd
        if "model.safetensors" in os.readlink(f"/proc/self/fd/{fd}") and "w" in mode:
            os.close(fd)
            return Full()
        return real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)
    assert main(["train", *QUIET, "--steps", "1", "--run-dir", str(run)]) == 1
    _one_line(capsys.readouterr().err, f"filesystem error: {run / 'model.safetensors'}: writing the run's weights "
                                       "failed: No space left on device (errno 28)")
    assert not [p.name for p in run.iterdir() if "model.safetensors" in p.name]  # no truncated file left


def test_disk_full_writing_the_metrics(tmp_path, capsys, monkeypatch):
    from lockstep.observe import MetricsWriter

    run = tmp_path / "run"
    real_write = MetricsWriter.write
    calls = []

    def write(self, record=None, **fields):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, record, **fields)

    monkeypatch.setattr(MetricsWriter, "write", write)
    assert main(["train", *QUIET, "--steps", "3", "--run-dir", str(run), "--output.no-save-weights"]) == 1
    _one_line(capsys.readouterr().err, f"{run / 'metrics.jsonl'}: writing a metrics record failed: "
                                       "No space left on device (errno 28)")
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_disk_full_writing_the_manifest(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"

    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_fdopen = os.fdopen

    def fake_fdopen(fd, mode="r", *args, **kwargs):  # lockstep.atomic writes through mkstemp's fd
        if "manifest.json" in os.readlink(f"/proc/self/fd/{fd}") and "w" in mode:
            os.close(fd)
            return Full()
        return real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fake_fdopen)
    assert main(["train", *QUIET, "--steps", "1", "--run-dir", str(run)]) == 1
    _one_line(capsys.readouterr().err, f"filesystem error: {run / 'manifest.json'}: writing the run manifest "
                                       "failed: No space left on device (errno 28)")
    assert not [p.name for p in run.iterdir() if "manifest.json" in p.name]  # no truncated file left
