"""The run-time ISA level (``lockstep.ops.isa``): detection, the ``$LOCKSTEP_CPU_ISA`` cap, forcing.

Every kernel family asks it which build to run, so: the level never exceeds what the CPU runs, a
cap lowers it and cannot raise it, an unknown value is an error naming the variable, forcing is
undone on exit, and each level's build flags select the matching C path.
"""

from __future__ import annotations

import os

import pytest

from lockstep.ops import isa


def test_detected_level_follows_the_cpu_flags():
    flags = isa.cpu_flags()
    cap = os.environ.get(isa.ENV)
    top = min(cap.lower(), isa.detected(), key=isa.LEVELS.index) if cap else isa.detected()
    assert isa.detected() in isa.LEVELS and isa.runnable()[0] == "portable" and isa.runnable()[-1] == top
    if isa.detected() != "portable":
        assert "avx512f" in flags
    if isa.detected() == "amx":
        assert {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags
    assert os.environ.get(isa.ENV) or isa.level() == isa.detected()


@pytest.mark.parametrize("cap", isa.LEVELS)
def test_the_environment_caps_the_level_and_never_raises_it(cap, monkeypatch):
    monkeypatch.setenv(isa.ENV, cap.upper())  # read when the level is first asked for (here: reset)
    monkeypatch.setattr(isa, "_level", None)
    assert isa.level() == min(cap, isa.detected(), key=isa.LEVELS.index)
    assert isa.describe()["cpu_isa_cap"] == cap.upper()
    # a capped process tests only the levels under the cap (as a CPU without the higher ones would)
    assert isa.runnable()[-1] == isa.level()


def test_an_unknown_level_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setattr(isa, "_level", None)
    with pytest.raises(ValueError, match=r"LOCKSTEP_CPU_ISA='avx2': expected one of portable, avx512, amx"):
        isa.level()
    monkeypatch.delenv(isa.ENV)
    monkeypatch.setattr(isa, "_level", None)
    assert isa.level() == isa.detected()


def test_forced_is_scoped_and_refuses_levels_the_cpu_lacks():
    before = isa.level()
    with isa.forced("portable"):
        assert isa.level() == "portable" and not isa.at_least("avx512") and not isa.avx512_bf16()
        assert isa.describe()["cpu_isa"] == "portable"
    assert isa.level() == before
    missing = [level for level in isa.LEVELS if level not in isa.runnable()]
    for level in missing:
        with pytest.raises(ValueError, match="this CPU runs only"):
            with isa.forced(level):
                pass
    with pytest.raises(ValueError, match="expected one of"):
        with isa.forced("sse"):
            pass


@pytest.mark.skipif(not isa._X86, reason="the x86 flags")
def test_build_flags_drop_avx512_and_amx_below_their_levels():
    assert "-mno-avx512f" in isa.march_flags("portable") and "-mno-amx-tile" in isa.march_flags("portable")
    assert "-mno-avx512f" not in isa.march_flags("avx512") and "-mno-amx-tile" in isa.march_flags("avx512")
    assert isa.march_flags("amx") == ["-march=native"]
