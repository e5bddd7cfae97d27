"""The packed-linear ops' C++ kernels (``csrc/packed_linear_op.cpp``): built once per machine, loaded into torch.

:mod:`lockstep.generate.packed` defines ``lockstep::packed_linear`` / ``packed_linear_cat`` and a
Python kernel for them; where this library builds, its C++ kernels serve the ops instead (a call
~1-2 us besides the product, against ~6-8 us through the Python kernel: 121 calls a SmolLM2 decode
step) and hand missing or stale packs to the Python kernel (``lockstep::_packed_linear_py``).

Built with the C++ compiler (``$CXX``, else ``g++``) against this torch's headers and libraries by
:func:`lockstep.ops.cbuild.build_shared` (cached under ``$LOCKSTEP_CACHE/kernels``, keyed by the source,
compiler, flags, torch version and CPU; a cold build takes ~6 CPU seconds, ~18 s wall on this
2-vCPU host under load: once per machine and torch version). ``$LOCKSTEP_NO_C_KERNELS`` (as for the
C kernels) or ``$LOCKSTEP_NO_CPP_OPS`` keep the Python kernels.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

from lockstep.ops.cbuild import build_shared

_SOURCE = Path(__file__).parent / "csrc" / "packed_linear_op.cpp"


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    return ["-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DLOCKSTEP_TORCH_VERSION={torch.__version__}", *includes]


def _libs() -> list[str]:
    from torch.utils import cpp_extension

    [lib] = cpp_extension.library_paths()
    return [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


@functools.cache
def load() -> bool:
    """Build (once) and load the C++ kernels into torch; whether they serve the packed-linear ops.
    Call after the ops' schemas are defined (:mod:`lockstep.generate.packed` does)."""
    if os.environ.get("LOCKSTEP_NO_CPP_OPS"):
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    path = build_shared("packed_linear_op", [_SOURCE], _flags(), "the packed-linear C++ op", compiler, _libs())
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError):
        return False
    return True
