"""What a person watching the run sees: a tqdm progress bar and an end-of-run summary table.

``ProgressBar.update(step, loss=..., tokens_per_s=...)`` moves the bar to ``step`` (tqdm supplies
rate and ETA) and shows the fields compactly. ``enabled=False`` (non-zero ranks) prints nothing at
all, ``write`` included.
"""

from __future__ import annotations

import math
import sys
from types import TracebackType
from typing import Any

from tqdm import tqdm

_SHORT = {"tokens_per_s": "tok/s", "learning_rate": "lr", "grad_norm": "gnorm"}


def format_value(v: Any) -> str:
    """Compact human form: 1234567 -> ``1.23M``, 0.000123 -> ``1.23e-04``, 2.5 -> ``2.5``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    a = abs(v)
    for unit, scale, threshold in (("T", 1e12, 1e12), ("G", 1e9, 1e9), ("M", 1e6, 1e6),
                                   ("k", 1e3, 1e4)):
        if a >= threshold:
            return f"{v / scale:.3g}{unit}"
    if isinstance(v, int):
        return str(v)
    if a != 0 and a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


class ProgressBar:
    """A training progress bar on tqdm; a context manager."""

    def __init__(self, total_steps: int, desc: str = "train", enabled: bool = True,
                 initial: int = 0) -> None:
        self.enabled = enabled
        self._bar = None
        if enabled:
            tty = sys.stderr.isatty()
            self._bar = tqdm(total=total_steps, desc=desc, initial=initial, unit="step",
                             dynamic_ncols=True, mininterval=0.1 if tty else 10.0)

    def update(self, step: int, **fields: Any) -> None:
        """Move to ``step`` (steps done so far) and show ``fields`` (loss, tokens_per_s, ...)."""
        if self._bar is None:
            return
        if fields:
            self._bar.set_postfix_str(
                " ".join(f"{_SHORT.get(k, k)}={format_value(v)}" for k, v in fields.items()),
                refresh=False)
        delta = step - self._bar.n
        if delta >= 0:
            self._bar.update(delta)
        else:  # went backwards (e.g. a rollback): jump there and redraw
            self._bar.n = step
            self._bar.refresh()

    def write(self, msg: str) -> None:
        """Print ``msg`` above the bar (nothing when disabled)."""
        if self.enabled:
            tqdm.write(msg)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            rows.extend(_flatten(v, name + "."))
        else:
            rows.append((name, v))
    return rows


def format_summary(summary: dict[str, Any], title: str = "run summary") -> str:
    """A two-column, aligned text table of ``summary`` (nested dicts flattened as ``a.b``)."""
    rows = [(k, format_value(v)) for k, v in _flatten(summary)]
    kw = max([len(k) for k, _ in rows] + [len(title)])
    vw = max([len(v) for _, v in rows] + [1])
    rule = "-" * (kw + vw + 3)
    lines = [title, rule] + [f"{k:<{kw}}   {v:>{vw}}" for k, v in rows] + [rule]
    return "\n".join(lines)
