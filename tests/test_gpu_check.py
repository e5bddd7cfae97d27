"""scripts/gpu_check.sh stays runnable: its CPU mode (``--device cpu --quick``) runs every check the
CUDA mode runs, on gloo, and passes; its failures make the exit status non-zero."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
LINE = re.compile(r"^(PASS|FAIL|SKIP) ([\w-]+): (.+)$")


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable})


@pytest.mark.slow
def test_cpu_quick_mode_passes_every_check():
    result = _run("--device", "cpu", "--quick", timeout=600)
    lines = [m.groups() for m in map(LINE.match, result.stdout.splitlines()) if m]
    status = {name: s for s, name, _ in lines}
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert status == {"pretrain-1proc": "PASS", "generate-cli": "PASS", "pretrain-2proc": "SKIP", "hf-parity": "PASS",
                      "batch-invariant": "PASS", "checkpoint": "PASS", "transport": "PASS", "rl-debug": "PASS",
                      "rl-colocated": "SKIP"}, \
        result.stdout


def test_bad_arguments_and_a_missing_cuda_exit_non_zero():
    assert _run("--device", "tpu", timeout=30).returncode == 2
    assert _run("--frobnicate", timeout=30).returncode == 2
    if not torch.cuda.is_available():
        result = _run("--device", "cuda", timeout=120)
        assert result.returncode == 1 and re.search(r"^FAIL cuda: .*no CUDA device", result.stdout, re.M), result.stdout


def _checks_module():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "scripts" / "gpu_checks.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    return checks


def test_a_failed_check_fails_the_run(monkeypatch, capsys):
    checks = _checks_module()
    monkeypatch.setitem(checks.CHECKS, "broken", lambda device, tmp: 1 / 0)
    monkeypatch.setitem(checks.CHECKS, "fine", lambda device, tmp: ("PASS", "ok"))
    assert checks.main(["--device", "cpu", "fine", "broken"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert LINE.match(out[0]).groups()[:2] == ("PASS", "fine")
    assert LINE.match(out[1]).groups()[:2] == ("FAIL", "broken") and "ZeroDivisionError" in out[1]


def test_batch_invariant_check_off_the_cpu_reports_cpu_only(tmp_path):
    """The CUDA branch of the batch-invariance check, on the meta device: the engine's refusal is
    what passes it (SKIP, "CPU-only"); the trainer-side probe cannot run on meta and is reported."""
    status, detail = _checks_module().check_batch_invariant(torch.device("meta"), tmp_path)
    assert status == "SKIP" and detail.startswith("CPU-only: the engine refuses it on meta"), detail
    assert "(engine.batch_invariant)" in detail and "trainer scores alone vs batched on meta: raised" in detail
