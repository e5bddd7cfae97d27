"""Checkpoint recovery through the trainer: nothing that could hold data is deleted at start-up, a
corrupt newest checkpoint falls back to the previous one (loaded completely: bitwise), and
``--resume-from STEP`` picks one (issue #15, item 4).

One base run (debug recipe, 6 planned steps, stopped after 4, a checkpoint every step, keep all) is
made once; each test works on a copy of it. "Bitwise" is checked on the state itself: the live
tensors right after the fallback resume equal the step-3 checkpoint's (model and optimizer, the
optimizer step counters included), the RNG and loader states equal step 3's saved ones, and the
step-4 checkpoint the resumed run writes equals the one the uninterrupted base run wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import LocalStorage
from lockstep.checkpoint.reader import read_full_state
from lockstep.checkpoint.train_state import rng_state
from lockstep.cli import main, resolve_config

pytestmark = pytest.mark.xdist_group("trainer")

COMMON = ["--recipe", "debug", "--steps", "6", "--checkpoint-every", "1", "--checkpoint.keep", "0",
          "--checkpoint.mode", "sync", "--validation.every", "0", "--output.no-progress",
          "--output.sample-tokens", "0", "--output.no-parity-check", "--output.no-save-weights",
          "--output.no-tensorboard"]


@pytest.fixture(scope="module")
def base(computed_once) -> Path:
    """The base run, made once per test run (tests copy it, never change it)."""
    def make(root: Path) -> None:
        assert main(["train", *COMMON, "--run-dir", str(root / "base"), "--stop-after", "4"]) == 0

    run = computed_once("recovery base", make) / "base"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == \
        ["latest", "step-00000001", "step-00000002", "step-00000003", "step-00000004"]
    return run


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _flip_last_shard(step_dir: Path) -> None:
    """One flipped bit in the big shard, which is read after the small one (the optimizer step
    counters): a load that stops there has already overwritten part of the state."""
    shard = sorted(step_dir.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))


def _aside(run: Path) -> dict[str, Path]:
    folder = run / "checkpoints" / "set-aside"
    return {p.name.split(".")[0] + "." + p.name.split(".")[1].split("-")[0]: p
            for p in folder.iterdir()} if folder.exists() else {}


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Two checkpoints hold bitwise the same tensors and per-rank state (RNG, loader position)."""
    (sa, ta, _), (sb, tb, _) = read_full_state(LocalStorage(a.parent), int(a.name[5:])), \
        read_full_state(LocalStorage(b.parent), int(b.name[5:]))
    assert sa == sb and ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])]
    ranks = sorted(f.name for f in a.glob("rank-*.json"))
    assert ranks == sorted(f.name for f in b.glob("rank-*.json"))
    for name in ranks:
        assert json.loads((a / name).read_text())["state"] == json.loads((b / name).read_text())["state"], name


def test_an_index_less_step_dir_survives_resume(base, tmp_path):
    run = _copy(base, tmp_path)
    step4 = run / "checkpoints" / "step-00000004"
    (step4 / "index.json").unlink()
    kept = _files(step4)
    with pytest.warns(UserWarning, match=r"moved aside, kept, not loaded: step-00000004 has no index\.json"):
        assert main(["train", *COMMON, "--run-dir", str(run), "--resume", "--stop-after", "5"]) == 0
    moved = _aside(run)["step-00000004.incomplete"]
    assert _files(moved) == kept  # every byte still there, just out of the way
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumed"]["from_step"] == 3
    # this run re-made step 4 from step 3: the same checkpoint the base run made
    _assert_same_checkpoint(run / "checkpoints" / "step-00000004", base / "checkpoints" / "step-00000004")


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_bitwise(base, tmp_path):
    from lockstep.train.trainer import Trainer

    run = _copy(base, tmp_path)
    _flip_last_shard(run / "checkpoints" / "step-00000004")
    corrupt = _files(run / "checkpoints" / "step-00000004")
    config, _ = resolve_config([*COMMON, "--run-dir", str(run), "--resume", "--stop-after", "4"])
    with pytest.warns(UserWarning, match=r"step 4 failed verification \(.*step-00000004/rank-00000-1\.safetensors: "
                                         r"corrupt checkpoint file.*resuming from step 3"):
        trainer = Trainer(config)
    assert trainer.start_step == 3 and trainer.resumed["skipped"][0]["step"] == 4
    # the live state is step 3's, completely: nothing of the half-read step 4 is left
    _, saved, _ = read_full_state(LocalStorage(run / "checkpoints"), 3)
    live = {name: slot.tensor for name, slot in trainer.checkpointing.slots().items()}
    assert live.keys() == saved.keys()
    assert all(torch.equal(live[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(live[k], saved[k])]
    state3 = json.loads((run / "checkpoints" / "step-00000003" / "rank-00000.json").read_text())["state"]
    assert rng_state() == state3["rng"]
    assert trainer.data.train.state_dict() == state3["data"]
    trainer.fit()
    # the corrupt checkpoint is kept, byte for byte, out of the way; the re-made step 4 is the base run's
    assert _files(_aside(run)["step-00000004.corrupt"]) == corrupt
    _assert_same_checkpoint(run / "checkpoints" / "step-00000004", base / "checkpoints" / "step-00000004")
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    base_losses = {r["step"]: r["loss"] for r in map(json.loads, (base / "metrics.jsonl").read_text().splitlines())
                   if "loss" in r}
    assert losses == base_losses


def test_resume_from_picks_a_step_and_sets_the_newer_ones_aside(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    newer = {s: _files(run / "checkpoints" / f"step-0000000{s}") for s in (3, 4)}
    with pytest.warns(UserWarning, match=r"step 3 is newer than checkpoint\.resume_from=2"):
        assert main(["train", *COMMON, "--run-dir", str(run), "--resume-from", "2", "--stop-after", "3"]) == 0
    assert "from the step 2 checkpoint" in capsys.readouterr().out
    aside = _aside(run)
    assert {s: _files(aside[f"step-0000000{s}.superseded"]) for s in (3, 4)} == newer
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == \
        ["step-00000001", "step-00000002", "step-00000003"]
    _assert_same_checkpoint(run / "checkpoints" / "step-00000003", base / "checkpoints" / "step-00000003")


def test_resume_from_a_missing_or_corrupt_step_is_a_clear_error(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    assert main(["train", *COMMON, "--run-dir", str(run), "--resume-from", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint.resume_from: no complete checkpoint at step 7" in err
    assert "available: 1, 2, 3, 4" in err
    _flip_last_shard(run / "checkpoints" / "step-00000003")
    assert main(["train", *COMMON, "--run-dir", str(run), "--resume-from", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "checkpoint.resume_from: the step 3 checkpoint" in err and "failed verification" in err
    assert "step-00000003/rank-00000-1.safetensors" in err
    # an explicit choice never falls back, and nothing was moved
    assert not _aside(run) and len(list((run / "checkpoints").glob("step-*"))) == 4


def test_no_verifiable_checkpoint_names_each_failure(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    for s in (1, 2, 3, 4):
        _flip_last_shard(run / "checkpoints" / f"step-0000000{s}")
    assert main(["train", *COMMON, "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resume: no checkpoint in" in err and "verifies" in err
    assert all(f"step {s}: " in err for s in (1, 2, 3, 4))
    assert len(list((run / "checkpoints").glob("step-*"))) == 4  # nothing moved when nothing loads


def test_a_new_run_refuses_a_checkpoint_location_it_would_prune(base, tmp_path, capsys):
    before = {p.name for p in (base / "checkpoints").iterdir()}
    assert main(["train", *COMMON, "--run-dir", str(tmp_path / "new"), "--checkpoint.keep", "1",
                 "--checkpoint.storage", str(base / "checkpoints"), "--stop-after", "1"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.storage:" in err and "already holds checkpoints (steps 1, 2, 3, 4)" in err
    assert {p.name for p in (base / "checkpoints").iterdir()} == before


def test_start_up_removes_only_index_less_staging_and_sets_the_rest_aside(tmp_path):
    from lockstep.checkpoint import Checkpointer, Slot

    ckpts = tmp_path / "ckpts"
    state = {"model/w": torch.arange(12, dtype=torch.float32)}
    Checkpointer(LocalStorage(ckpts), mode="sync", keep=0).save(1, {k: Slot.of(v) for k, v in state.items()}, {}, {})
    shutil.copytree(ckpts / "step-00000001", ckpts / "step-00000002.partial")  # saved, not yet renamed
    shutil.copytree(ckpts / "step-00000001", ckpts / ".step-00000001.old-1a2b3c4d")  # a replaced copy
    (ckpts / "step-00000003.partial").mkdir()  # a save cut off before its index
    (ckpts / "step-00000003.partial" / "rank-00000-0.safetensors").write_bytes(b"half")
    with pytest.warns(UserWarning) as caught:
        Checkpointer(LocalStorage(ckpts), mode="sync")
    messages = [str(w.message) for w in caught]
    assert any("removed incomplete saves ['step-00000003.partial']" in m for m in messages)
    assert sum("moved aside, kept, not loaded" in m for m in messages) == 2
    names = sorted(p.name.rsplit("-", 1)[0] for p in (ckpts / "set-aside").iterdir())
    assert names == ["step-00000001.old-1a2b3c4d.replaced", "step-00000002.partial.unpublished"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "set-aside", "step-00000001"]
    for moved in (ckpts / "set-aside").iterdir():  # whole checkpoints, readable where they are
        assert _files(moved) == _files(ckpts / "step-00000001")


def test_rl_takes_resume_from_too(tmp_path):
    from lockstep.cli_rl import resolve_rl_config

    config, _ = resolve_rl_config(["--recipe", "rl-debug", "--run-dir", str(tmp_path), "--resume-from", "2"])
    assert config.resume and config.checkpoint.resume_from == 2
    config, _ = resolve_config(["--recipe", "debug", "--run-dir", str(tmp_path), "--resume"])
    assert config.resume and config.checkpoint.resume_from == 0  # --resume is not taken for --resume-from


@pytest.mark.slow
def test_a_shard_only_one_rank_reads_fails_the_checkpoint_for_every_rank(tmp_path):
    """FSDP over 2 ranks: rank 1's shard of the newest checkpoint is bit-flipped, which only rank 1
    reads; both ranks must fall back to the previous checkpoint together and re-make the newest one
    bitwise (a rank that went on alone would hang the other or mix two steps)."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "lockstep.cli", "train", *COMMON, "--run-dir", str(run), "--nproc", "2",
           "--parallel.dp-shard", "2", "--stop-after", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    step3 = run / "checkpoints" / "step-00000003"
    pristine = tmp_path / "pristine" / "step-00000003"
    shutil.copytree(step3, pristine)
    _flip_last_shard(step3)  # the last file name sorts under rank 1
    assert sorted(step3.glob("*.safetensors"))[-1].name.startswith("rank-00001-")
    second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "from the step 2 checkpoint" in second.stdout
    assert "step 3 failed verification (rank 1: " in second.stderr
    _assert_same_checkpoint(step3, pristine)
