"""A run's directory: choose it, check it is free (or resumable) and writable, agree on it over ranks,
and the small file helpers every run uses (metrics truncation on resume, final weights, seeding).

Filesystem failures here are :class:`FilesystemError`: one line naming the path and the operation
(the CLI prints it without a traceback and exits 1).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lockstep.checkpoint import CheckpointConfig, storage_from_uri
from lockstep.checkpoint.checkpointer import latest_step, reading
from lockstep.checkpoint.writer import complete_steps
from lockstep.atomic import FilesystemError, atomic_open, os_reason  # noqa: F401 (re-exported)
from lockstep.config.base import ConfigError
from lockstep.models.hf.verified import encode_weights
from lockstep.observe import read_metrics


def default_run_dir(recipe: str) -> Path:
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def has_checkpoint(config: CheckpointConfig, run_dir: Path) -> int | None:
    storage = storage_from_uri(config.location(run_dir), endpoint_url=config.endpoint_url)
    return reading(storage, "listing checkpoints", lambda: latest_step(storage))


def check_run_dir(config: CheckpointConfig, run_dir: Path, resume: bool) -> None:
    """A resumed run needs a complete checkpoint; a new one needs a directory without a run in it, and
    a checkpoint location without checkpoints (whose pruning would delete another run's)."""
    if resume:
        if has_checkpoint(config, run_dir) is None:
            raise ConfigError(f"resume: no complete checkpoint in {config.location(run_dir)} to continue from")
        return
    if config.resume_from:
        raise ConfigError(f"checkpoint.resume_from: set to {config.resume_from}, but this run is not resumed "
                          "(add --resume, or use --resume-from STEP)")
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run_dir: {run_dir} already holds a run (metrics.jsonl); choose another, or --resume it")
    storage = storage_from_uri(config.location(run_dir), endpoint_url=config.endpoint_url)
    steps = reading(storage, "listing checkpoints", lambda: complete_steps(storage))
    if steps:
        raise ConfigError(f"checkpoint.storage: {storage.describe()} already holds checkpoints (steps "
                          f"{', '.join(map(str, steps))}) that a new run would prune; choose another, or --resume")


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and its parents) and check a file can be created in it: a path that is or
    lies under a file, or a directory that cannot be written, is a FilesystemError now rather than a
    traceback at the first metrics record or checkpoint."""
    blocker = next((p for p in [run_dir, *run_dir.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == run_dir else f"lies under {blocker}, which is a file"
        raise FilesystemError(f"run_dir: {run_dir} {where}, not a directory (creating the run directory)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FilesystemError(f"run_dir: {err.filename or run_dir}: creating the run directory failed: "
                              f"{os_reason(err)}") from None
    probe = run_dir / f".lockstep-write-test-{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as err:
        raise FilesystemError(f"run_dir: {run_dir} is not writable (creating a file in it failed: "
                              f"{os_reason(err)})") from None


def agree_on_run_dir(config, *, main: bool, group=None, distributed: bool = False) -> Path:
    """The run directory of ``config`` (a RunConfig): the main rank chooses and checks it and creates
    it; every rank of ``group`` then uses that same path (a default name carries a timestamp, which
    ranks must not each pick), or raises the main rank's error (ConfigError, FilesystemError,
    CheckpointError). Collective over ``group``."""
    from lockstep.checkpoint.format import CheckpointError

    found: list = [None]
    if main:
        try:
            run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(config.recipe)
            blocker = next((p for p in [run_dir, *run_dir.parents] if p.exists() and not p.is_dir()), None)
            if blocker is None:  # else make_run_dir names it (the checks below would only find no run)
                check_run_dir(config.checkpoint, run_dir, config.resume)
            make_run_dir(run_dir)
            found[0] = str(run_dir)
        except (ConfigError, FilesystemError, CheckpointError) as err:
            found[0] = err
    if distributed:
        dist.broadcast_object_list(found, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
    if isinstance(found[0], Exception):
        raise found[0]
    return Path(found[0])


def truncate_metrics(path: Path, step: int) -> list[dict]:
    """Drop records past ``step`` (written after the checkpoint a run resumes from); returns the kept ones."""
    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode(), "truncating the metrics to the resumed step")
    return kept


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def save_weights(state: dict[str, torch.Tensor], path: Path, tied: bool) -> None:
    """Write a state dict as safetensors (a tied head is stored once, under the embedding). Non-finite
    weights are refused (:class:`~lockstep.run.nonfinite.NonFiniteError` naming the tensors): a run
    never leaves NaN/inf weights behind as its result."""
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        from lockstep.run.nonfinite import NonFiniteError

        raise NonFiniteError(f"{path} not written: non-finite values in {len(bad)} tensor(s) "
                             f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    if tied:
        state.pop("output.weight", None)
    write_atomic(path, encode_weights(state), "writing the run's weights")  # checksummed: loads verify it


def write_atomic(path: Path, data: bytes, what: str) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync'ed, then renamed: a full disk or a
    crash leaves the old file (or none), never a truncated one that looks whole. An OS error is a
    FilesystemError naming ``path`` and ``what`` was being done."""
    try:
        with atomic_open(path) as handle:
            handle.write(data)
    except OSError as err:
        raise FilesystemError(f"{path}: {what} failed: {os_reason(err)}") from None
