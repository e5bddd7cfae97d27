"""The run's metrics stream: one JSON object per line in ``metrics.jsonl``.

Each ``write`` is flushed before returning, so a crash loses nothing already logged (pass
``fsync=True`` to survive a host crash too). Tensors and numpy scalars become Python numbers.
Non-finite values (NaN, inf) are written as ``null`` and the record gains a ``nonfinite`` key
listing which keys they were, so a divergence is visible in the file rather than breaking JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from lockstep.observe._io import to_jsonable


def sanitize_record(record: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready form of one metrics record (see module docstring for the NaN rule)."""
    nonfinite: list[str] = []
    out = to_jsonable(dict(record), nonfinite=nonfinite)
    if nonfinite:
        out["nonfinite"] = nonfinite
    return out


class MetricsWriter:
    """Appends records to a JSON-lines file; use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Append one record (``record`` merged with ``fields``); returns what was written."""
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        clean = sanitize_record({**(record or {}), **fields})
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        return clean

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def closed(self) -> bool:
        return self._file is None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in order. A truncated last line (a crash mid-write) is
    skipped; a malformed line elsewhere raises ValueError naming the line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: malformed metrics line: {e}") from None
    return records
