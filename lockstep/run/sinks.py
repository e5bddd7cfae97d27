"""Metrics sinks: one interface (``write(record)``, ``close()``), one fan-out (:class:`RunLog`).

The main rank writes every record to ``metrics.jsonl`` (:class:`~lockstep.observe.MetricsWriter`,
the record of truth), and its numeric scalars to TensorBoard event files (``run_dir/tensorboard``)
and, when asked, an offline W&B run (``run_dir/wandb``). Other ranks keep ``logs/rank<r>.jsonl``.
A resumed run truncates the JSONL past the checkpoint's step and purges TensorBoard's later events.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from lockstep.observe import MetricsWriter, ProgressBar
from lockstep.run.config import SinkOutputs, import_wandb
from lockstep.run.directory import FilesystemError, os_reason, truncate_metrics


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> Any: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite scalars of a (sanitised) record, ``step`` excluded."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoardSink:
    """Scalars as TensorBoard events at the record's ``step`` (``purge_step``: drop a resumed run's
    events from that step on, which the interrupted run wrote after its checkpoint)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline Weights & Biases run in ``run_dir/wandb`` (``wandb sync`` uploads it later)."""

    def __init__(self, run_dir: Path, project: str, config: dict | None = None, resume: bool = False) -> None:
        wandb = import_wandb()
        self.run = wandb.init(mode="offline", dir=str(run_dir), project=project, name=run_dir.name,
                              config=config or {}, resume="allow" if resume else None)

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


class RunLog:
    """This rank's sinks; ``write`` returns the record as stored in JSON (tensors made numbers).

    ``resume_step``: a resumed run's checkpoint step (records past it are dropped first; the kept
    ones are in ``kept``). ``recipe``: the config tree W&B records as the run's config.
    """

    def __init__(self, run_dir: Path, output: SinkOutputs, *, rank: int, main: bool,
                 resume_step: int | None = None, recipe: dict | None = None) -> None:
        self.run_dir, self.main = Path(run_dir), main
        self.path = self.run_dir / ("metrics.jsonl" if main else f"logs/rank{rank}.jsonl")
        self.kept: list[dict] = truncate_metrics(self.path, resume_step) if resume_step is not None else []
        try:
            self.jsonl = MetricsWriter(self.path)
        except OSError as err:
            raise FilesystemError(f"{err.filename or self.path}: opening the metrics file failed: "
                                  f"{os_reason(err)}") from None
        self.sinks: list[MetricsSink] = []
        if main and output.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard",
                                              None if resume_step is None else resume_step + 1))
        if main and output.wandb:
            self.sinks.append(WandbSink(self.run_dir, output.wandb_project, recipe, resume=resume_step is not None))

    def write(self, record: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        try:
            clean = self.jsonl.write(record, **fields)
        except OSError as err:  # a full disk: one line naming the file, not a traceback
            raise FilesystemError(f"{self.path}: writing a metrics record failed: {os_reason(err)}") from None
        for sink in self.sinks:
            sink.write(clean)
        return clean

    def progress(self, total: int, desc: str, enabled: bool) -> ProgressBar:
        """The console bar (the main rank's only)."""
        return ProgressBar(total, desc=desc, enabled=enabled and self.main)

    def close(self) -> None:
        self.jsonl.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
