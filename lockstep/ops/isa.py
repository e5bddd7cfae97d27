"""The CPU instruction-set level lockstep's C kernels run at, decided at run time in this one place.

Levels, lowest first: ``"portable"`` (plain C, compiled for this CPU without AVX-512), ``"avx512"``
(AVX-512F; the bf16 kernels also run ``vdpbf16ps``'s arithmetic where the CPU has ``avx512_bf16``) and ``"amx"``
(Intel AMX tiles for bf16 products; the rest as avx512). :func:`detected` is the highest this CPU and
OS run: ``/proc/cpuinfo`` flags, and for AMX the kernel granting the tile state (``arch_prctl``).
``$LOCKSTEP_CPU_ISA`` (``portable|avx512|amx``) caps it (never raises it: a level the CPU lacks is
capped to what it has), so one machine can run and test every lower path; :func:`forced` does the
same in-process (tests). Every C kernel family asks :func:`level` which build and which kernel to
use, and builds one library per level (:func:`march_flags`), so a process running at a level uses
one kernel per product everywhere (trainer and generator alike).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
from collections.abc import Iterator
from pathlib import Path

LEVELS = ("portable", "avx512", "amx")
ENV = "LOCKSTEP_CPU_ISA"
_AMX_FLAGS = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")

_forced: str | None = None
_level: str | None = None  # resolved once (per forced() change): level() is called per kernel call


def cpu_flags_line() -> str:
    """This CPU's ``/proc/cpuinfo`` feature-flags line ("" where there is no such file)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``)."""
    return frozenset(cpu_flags_line().split(":", 1)[-1].split())


def _amx_permitted() -> bool:
    """Linux hands out AMX tile state only to processes that ask for it (arch_prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


@functools.cache
def detected() -> str:
    """The highest level this CPU (and OS) runs."""
    flags = cpu_flags()
    if not _X86 or "avx512f" not in flags:
        return "portable"
    return "amx" if _AMX_FLAGS <= flags and _amx_permitted() else "avx512"


def _parse(value: str, source: str) -> str:
    value = value.strip().lower()
    if value not in LEVELS:
        raise ValueError(f"{source}={value!r}: expected one of {', '.join(LEVELS)}")
    return value


def _cap(a: str, b: str) -> str:
    return min(a, b, key=LEVELS.index)


def level() -> str:
    """The level the kernels run at in this process now: :func:`detected`, capped by
    ``$LOCKSTEP_CPU_ISA`` and by :func:`forced`."""
    global _level
    if _level is None:
        chosen = detected()
        if os.environ.get(ENV):
            chosen = _cap(chosen, _parse(os.environ[ENV], ENV))
        if _forced is not None:
            chosen = _cap(chosen, _forced)
        _level = chosen
    return _level


def runnable() -> tuple[str, ...]:
    """The levels this process may run (what tests parametrize over): up to :func:`detected`,
    capped by ``$LOCKSTEP_CPU_ISA`` (so a capped run of the suite behaves as on a CPU without the
    higher levels)."""
    top = detected()
    if os.environ.get(ENV):
        top = _cap(top, _parse(os.environ[ENV], ENV))
    return LEVELS[: LEVELS.index(top) + 1]


def at_least(name: str) -> bool:
    """Whether :func:`level` is ``name`` or higher."""
    return LEVELS.index(level()) >= LEVELS.index(name)


def avx512_bf16() -> bool:
    """Whether the bf16 vector kernels (``vdpbf16ps``'s arithmetic) run here (level avx512 or amx, CPU flag)."""
    return at_least("avx512") and "avx512_bf16" in cpu_flags()


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    """Run the block at level ``name`` (a level this machine runs; :func:`runnable`)."""
    global _forced, _level
    name = _parse(name, "isa.forced")
    if name not in runnable():
        raise ValueError(f"isa.forced({name!r}): this CPU runs only {', '.join(runnable())}")
    before = _forced
    _forced, _level = name, None
    try:
        yield
    finally:
        _forced, _level = before, None


def march_flags(name: str) -> list[str]:
    """Compiler flags for a build at level ``name``: this CPU's instructions, less AVX-512 below
    avx512 and less AMX below amx (so the C sources' ``#if`` pick the matching path)."""
    flags = ["-march=native"]
    if _X86 and name != "amx":
        flags += ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    if _X86 and name == "portable":
        flags.append("-mno-avx512f")
    return flags


def describe() -> dict:
    """What a run manifest records: the level in use, what the CPU runs, and the cap asked for."""
    return {"cpu_isa": level(), "cpu_isa_detected": detected(), "cpu_isa_cap": os.environ.get(ENV) or None,
            "avx512_bf16": avx512_bf16()}
