"""Fixtures every test directory may use.

``isa_level``: run a test at one :mod:`lockstep.ops.isa` level (parametrize it indirectly over
``isa.runnable()``: the levels this machine can execute; a level the CPU lacks is not collected, the
lower ones still are), so one machine tests its AMX, AVX-512 and portable kernel paths alike.
"""

import pytest

from lockstep.ops import isa


@pytest.fixture
def isa_level(request) -> str:
    with isa.forced(request.param):
        yield request.param
