"""``lockstep train`` and ``lockstep rl`` go through one run framework: their run directories have the
same manifest sections, TensorBoard events of the step scalars, and the same checkpoint layout."""

from __future__ import annotations

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lockstep import numerics
from lockstep.cli import main
from lockstep.run import COMMON_SECTIONS

pytestmark = pytest.mark.xdist_group("trainer")


@pytest.fixture(scope="module")
def runs(computed_once):
    """A train and an rl run, made once per test run (the tests only read them)."""
    def make(root):
        assert main(["train", "--recipe", "debug", "--run-dir", str(root / "train"), "--steps", "3",
                     "--checkpoint.every", "2", "--checkpoint.mode", "sync", "--validation.every", "0",
                     "--output.no-progress", "--output.sample-tokens", "0", "--output.no-save-weights"]) == 0
        assert main(["rl", "--recipe", "rl-debug", "--run-dir", str(root / "rl"), "--steps", "3",
                     "--workers.generators", "0", "--checkpoint.every", "2", "--checkpoint.mode", "sync",
                     "--output.no-progress", "--output.no-save-weights"]) == 0
        numerics.set_batch_invariant(False)

    root = computed_once("run-dirs train and rl", make)
    return root / "train", root / "rl"


def test_same_manifest_sections(runs):
    train, rl = (json.loads((run / "manifest.json").read_text()) for run in runs)
    for manifest in (train, rl):
        assert set(COMMON_SECTIONS) <= set(manifest), set(COMMON_SECTIONS) - set(manifest)
        assert manifest["result"]["steps"] == 3
        assert manifest["checkpoint"]["every"] == 2 and manifest["kernels"]["device"] == "cpu"
        assert manifest["parallel"]["world_size"] == 1
    assert train["checkpoint"]["slots"] == rl["checkpoint"]["slots"] == ["model", "optimizer"]
    assert set(train["determinism"]) == set(rl["determinism"])
    assert set(train["model"]) >= {"family", "flavor", "parameters"} <= set(rl["model"])
    assert "data" in train and "workers" in rl  # each workload's own sections beside the common ones


@pytest.mark.parametrize("which, scalar", [(0, "loss"), (1, "loss"), (0, "grad_norm"), (1, "reward/mean")])
def test_tensorboard_has_the_step_scalars(runs, which, scalar):
    run = runs[which]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    logged = {r["step"]: r[scalar] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if scalar in r}
    events = {e.step: e.value for e in acc.Scalars(scalar)}
    assert sorted(events) == sorted(logged) == [1, 2, 3]
    assert all(events[s] == pytest.approx(logged[s], rel=1e-6) for s in logged)  # TB stores float32


def _layout(run):
    step_dirs = sorted((run / "checkpoints").glob("step-*"))
    index = json.loads((step_dirs[-1] / "index.json").read_text())
    files = sorted(p.name for p in step_dirs[-1].iterdir())
    return [d.name for d in step_dirs], index, files


def test_same_checkpoint_layout(runs):
    (train_steps, train, train_files), (rl_steps, rl, rl_files) = map(_layout, runs)
    assert train_steps == rl_steps == ["step-00000002", "step-00000003"]
    assert set(train) == set(rl)  # index.json keys
    shard = re.compile(r"^(index\.json|rank-\d+\.json|.+\.safetensors)$")
    assert all(shard.match(f) for f in train_files + rl_files), (train_files, rl_files)
    assert [re.sub(r"\d+", "N", f) for f in train_files] == [re.sub(r"\d+", "N", f) for f in rl_files]
    for index in (train, rl):
        prefixes = {name.split("/")[0] for name in index["tensors"]}
        assert prefixes == {"model", "optimizer"}, prefixes
    assert train["metadata"]["kind"] == "train" and rl["metadata"]["kind"] == "rl"
    assert set(train["metadata"]) == set(rl["metadata"])
