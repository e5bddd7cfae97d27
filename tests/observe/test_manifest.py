"""RunManifest keys, add_check persistence, update merging, and never-failing probes."""

import json

import torch

from lockstep.observe import RunManifest, collect_hardware, collect_versions, read_manifest
from lockstep.observe import manifest as manifest_mod

KEYS = {"recipe", "model", "versions", "hardware", "determinism", "kernels", "checks",
        "started_at"}


def test_manifest_keys_and_checks_persist(tmp_path):
    m = RunManifest(tmp_path / "run", recipe={"lr": 3e-4, "dtype": torch.bfloat16},
                    model={"n_layers": 2}, extra={"peak": {"value": 1e12}})
    path = m.write()
    data = json.loads(path.read_text())
    assert KEYS | {"peak"} <= set(data)
    assert data["recipe"]["dtype"] == "torch.bfloat16"
    assert data["checks"] == [] and data["kernels"] == {}
    assert data["determinism"]["seed"] is None
    assert data["determinism"]["threads"] == torch.get_num_threads()

    m.add_check("grad_parity", True, max_abs_diff=1e-6)
    m.add_check("loss_finite", False)
    checks = read_manifest(tmp_path / "run")["checks"]
    assert [(c["name"], c["passed"]) for c in checks] == [("grad_parity", True),
                                                          ("loss_finite", False)]
    assert checks[0]["max_abs_diff"] == 1e-6

    m.update(determinism={"seed": 1234}, kernels={"attention": "sdpa"}, finished_at="now")
    data = read_manifest(path)
    assert data["determinism"]["seed"] == 1234 and "threads" in data["determinism"]
    assert data["kernels"] == {"attention": "sdpa"} and data["finished_at"] == "now"
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_versions_and_hardware():
    v = collect_versions()
    assert v["torch"] == torch.__version__
    assert {"python", "lockstep", "numpy", "git_commit", "git_dirty"} <= set(v)
    h = collect_hardware()
    assert h["logical_cores"] >= 1 and h["torch_threads"] >= 1 and h["cpu"]
    assert h["cuda_available"] == torch.cuda.is_available()


def test_git_unavailable_is_unknown(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(manifest_mod.subprocess, "run", no_git)
    v = collect_versions()
    assert v["git_commit"] == "unknown" and v["git_dirty"] is None
