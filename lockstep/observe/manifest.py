"""The run manifest: ``manifest.json`` in a run dir says what ran, on what, and what was checked.

Top-level sections: ``recipe``, ``model``, ``versions``, ``hardware``, ``determinism``,
``kernels``, ``checks``, ``started_at`` (plus any ``extra`` ones). Every change is written
atomically, so the file on disk is always complete and current. The probes never raise: a value
that cannot be found is recorded as ``"unknown"`` (or None).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lockstep.atomic import FilesystemError, os_reason
from lockstep.observe._io import atomic_write_json, to_jsonable
from lockstep.observe._sysinfo import cpu_flags, cpu_model, total_memory_bytes, usable_cores
from lockstep.ops import isa

MANIFEST_NAME = "manifest.json"
_PKG_DIR = Path(__file__).resolve().parent.parent  # the lockstep package folder


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return "unknown"


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(_PKG_DIR), *args], capture_output=True, text=True,
                           timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def collect_git() -> dict[str, Any]:
    """``commit`` of the repo holding the lockstep sources and ``dirty`` (uncommitted changes,
    untracked files included, under the package folder). ``"unknown"``/None when the package is
    not tracked by git (e.g. installed from a wheel inside some other repo's venv)."""
    if _git("ls-files", "--error-unmatch", "__init__.py") is None:
        return {"commit": "unknown", "dirty": None}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".")
    return {"commit": commit or "unknown", "dirty": None if status is None else bool(status)}


def collect_versions() -> dict[str, Any]:
    """Python, torch, lockstep and numpy versions plus the lockstep git commit and dirty flag."""
    try:
        import numpy

        numpy_version = numpy.__version__
    except Exception:
        numpy_version = "unknown"
    git = collect_git()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lockstep": _dist_version("lockstep"),
        "numpy": numpy_version,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
    }


def collect_hardware() -> dict[str, Any]:
    """CPU model and ISA flags, core counts, torch threads, memory, platform and CUDA devices."""
    hw: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "kernel_isa": isa.describe(),  # the level lockstep's C kernels run at (lockstep.ops.isa)
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "memory_bytes": total_memory_bytes(),
        "platform": platform.platform(),
        "python_impl": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "cuda_available": False,
        "cuda_devices": [],
    }
    try:
        hw["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        hw["torch_cpu_capability"] = "unknown"
    try:
        if torch.cuda.is_available():
            hw["cuda_available"] = True
            hw["cuda_devices"] = [torch.cuda.get_device_name(i)
                                  for i in range(torch.cuda.device_count())]
            hw["cuda_version"] = torch.version.cuda
    except Exception:
        pass
    return hw


def collect_determinism(seed: int | None = None) -> dict[str, Any]:
    """The determinism-relevant torch settings now; ``seed`` is filled in by the trainer."""
    return {
        "seed": seed,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "threads": torch.get_num_threads(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


class RunManifest:
    """Builds ``<run_dir>/manifest.json``; ``write`` it once, then ``add_check``/``update`` rewrite it."""

    def __init__(self, run_dir: str | os.PathLike[str], recipe: dict[str, Any],
                 model: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / MANIFEST_NAME
        self.data: dict[str, Any] = {
            "recipe": recipe,
            "model": model,
            "versions": collect_versions(),
            "hardware": collect_hardware(),
            "determinism": collect_determinism(),
            "kernels": {},
            "checks": [],
            "started_at": _now(),
        }
        self.data.update(extra or {})

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON types (non-finite floats become None)."""
        return to_jsonable(self.data)

    def write(self) -> Path:
        """Write the manifest atomically; returns its path."""
        try:
            atomic_write_json(self.path, self.to_dict())
        except OSError as err:
            raise FilesystemError(f"{self.path}: writing the run manifest failed: {os_reason(err)}") from None
        return self.path

    def add_check(self, name: str, passed: bool, **details: Any) -> None:
        """Record one check result (``{"name", "passed", "at", **details}``) and rewrite the file."""
        self.data["checks"].append({"name": name, "passed": bool(passed), "at": _now(), **details})
        self.write()

    def update(self, **sections: Any) -> None:
        """Merge sections: a dict into an existing dict section key by key, anything else replaces.
        The file is rewritten."""
        for key, value in sections.items():
            current = self.data.get(key)
            if isinstance(current, dict) and isinstance(value, dict):
                current.update(value)
            else:
                self.data[key] = value
        self.write()


def read_manifest(run_dir_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a manifest from a run dir (or the manifest file itself)."""
    p = Path(run_dir_or_path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    return json.loads(p.read_text(encoding="utf-8"))
