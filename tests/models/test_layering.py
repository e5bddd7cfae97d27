"""Models know nothing of parallelism: importing every lockstep.models module pulls in no
lockstep.parallel module (the plans live in lockstep/parallel and wrap the models from outside)."""

import subprocess
import sys

_PROBE = """
import importlib, pkgutil, sys
import lockstep.models
names = [m.name for m in pkgutil.walk_packages(lockstep.models.__path__, "lockstep.models.")]
for name in names:
    importlib.import_module(name)
assert len(names) > 10, names
print("\\n".join(sorted(m for m in sys.modules if m.startswith("lockstep.parallel"))))
"""


def test_models_import_nothing_from_parallel():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"lockstep.models imported parallel modules:\n{out}"
