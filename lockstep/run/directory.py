"""A run's directory: choose it, check it is free (or resumable), agree on it over ranks, and the
small file helpers every run uses (metrics truncation on resume, final weights, seeding)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from lockstep.checkpoint import CheckpointConfig, latest_step, storage_from_uri
from lockstep.config.base import ConfigError
from lockstep.observe import read_metrics


def default_run_dir(recipe: str) -> Path:
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def has_checkpoint(config: CheckpointConfig, run_dir: Path) -> int | None:
    return latest_step(storage_from_uri(config.location(run_dir), endpoint_url=config.endpoint_url))


def check_run_dir(config: CheckpointConfig, run_dir: Path, resume: bool) -> None:
    """A resumed run needs a complete checkpoint; a new one needs a directory without a run in it."""
    if resume:
        if has_checkpoint(config, run_dir) is None:
            raise ConfigError(f"resume: no complete checkpoint in {config.location(run_dir)} to continue from")
    elif (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run_dir: {run_dir} already holds a run (metrics.jsonl); choose another, or --resume it")


def agree_on_run_dir(config, *, main: bool, group=None, distributed: bool = False) -> Path:
    """The run directory of ``config`` (a RunConfig): the main rank chooses and checks it and creates
    it; every rank of ``group`` then uses that same path (a default name carries a timestamp, which
    ranks must not each pick), or raises the main rank's ConfigError. Collective over ``group``."""
    found: list = [None]
    if main:
        try:
            run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(config.recipe)
            check_run_dir(config.checkpoint, run_dir, config.resume)
            run_dir.mkdir(parents=True, exist_ok=True)
            found[0] = str(run_dir)
        except ConfigError as err:
            found[0] = err
    if distributed:
        dist.broadcast_object_list(found, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
    if isinstance(found[0], ConfigError):
        raise found[0]
    return Path(found[0])


def truncate_metrics(path: Path, step: int) -> list[dict]:
    """Drop records past ``step`` (written after the checkpoint a run resumes from); returns the kept ones."""
    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
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
    save_file(state, str(path))
