"""Fixtures every test directory may use.

``isa_level``: run a test at one :mod:`lockstep.ops.isa` level (parametrize it indirectly over
``isa.runnable()``: the levels this machine can execute; a level the CPU lacks is not collected, the
lower ones still are), so one machine tests its AMX, AVX-512 and portable kernel paths alike.

``computed_once``: ``computed_once(key, make) -> Path``, a directory that ``make(path)`` fills once per
test run, shared by every xdist worker (``make test`` runs two). A module-scoped fixture alone runs
once per worker that receives one of the module's tests, and xdist's ``loadgroup`` cannot keep a
module on one worker here (pytest 9 ignores the ``_nodeid`` suffix xdist 3.8 sets: the groups are
never formed), so expensive set-ups (a training run, a multi-process spawn) go through this.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest

from lockstep.ops import isa


@pytest.fixture
def isa_level(request) -> str:
    with isa.forced(request.param):
        yield request.param


@pytest.fixture(scope="session")
def computed_once(tmp_path_factory) -> Callable[[str, Callable[[Path], object]], Path]:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory: each worker's basetemp is popen-gwN inside it
    root = root / "computed-once"
    root.mkdir(exist_ok=True)

    def get(key: str, make: Callable[[Path], object]) -> Path:
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", key)[:80] + "-" + hashlib.sha1(key.encode()).hexdigest()[:10]
        path, done = root / name, root / f"{name}.done"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here for the first one's result
            if not done.exists():
                if path.exists():  # an attempt that failed: its own test reported why
                    shutil.rmtree(path)
                path.mkdir()
                make(path)
                done.touch()
        return path

    return get
