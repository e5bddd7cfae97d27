"""Per-step wall-clock timing of named training stages ("data", "forward", "backward", ...).

    timer = StageTimer()
    with timer.stage("forward"):
        ...
    metrics.update(timer.pop())   # {"time/forward": 0.012, ...}, then reset

Repeated uses of a name within a step add up. Re-entering a name that is already open (recursion,
or a helper that times itself inside a caller that does too) counts the outermost span only, so
wall time is never double-counted. Different names may nest and overlap freely. ``sync`` (e.g.
``torch.cuda.synchronize``) is called at each outermost enter and exit so that asynchronous device
work is charged to the stage that launched it.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter


class _Stage:
    """Reusable context manager for one stage name (one object per name, so entering is cheap)."""

    __slots__ = ("_timer", "name", "_depth", "_start")

    def __init__(self, timer: StageTimer, name: str) -> None:
        self._timer = timer
        self.name = name
        self._depth = 0
        self._start = 0.0

    def __enter__(self) -> _Stage:
        if self._depth == 0:
            if self._timer._sync is not None:
                self._timer._sync()
            self._start = perf_counter()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self._timer._sync is not None:
                self._timer._sync()
            totals = self._timer._totals
            totals[self.name] = totals.get(self.name, 0.0) + (perf_counter() - self._start)


class StageTimer:
    """Accumulates wall seconds per stage name until :meth:`pop`."""

    def __init__(self, prefix: str = "time/", sync: Callable[[], None] | None = None) -> None:
        self.prefix = prefix
        self._sync = sync
        self._stages: dict[str, _Stage] = {}
        self._totals: dict[str, float] = {}

    def stage(self, name: str) -> _Stage:
        """Context manager timing one stage; ``with timer.stage("forward"): ...``."""
        s = self._stages.get(name)
        if s is None:
            s = self._stages[name] = _Stage(self, name)
        return s

    def peek(self) -> dict[str, float]:
        """The totals so far this step, keyed ``prefix + name``, without resetting."""
        return {self.prefix + k: v for k, v in self._totals.items()}

    def pop(self) -> dict[str, float]:
        """The totals of every stage completed since the last pop, then reset.

        A stage still open is charged, when it closes, to the next pop."""
        out = self.peek()
        self._totals = {}
        return out
