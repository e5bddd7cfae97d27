"""The checkpoint policy of a run (pretraining and RL alike): what is saved, when, which config
changes a resume accepts, and each rank's own state.

Slots: ``model/<fqn>``, ``optimizer/<fqn>/<state>`` and ``<name>/<fqn>`` for each extra module (the
RL reference policy: ``reference/``), aliasing the live tensors, written by the
:class:`~lockstep.checkpoint.Checkpointer` (staged, background writer, atomic; same layout on disk
for every run kind). Per-rank JSON state: RNG, optimizer groups, and what the workload's
:class:`RankState` adds (the loader position; the RL policy version).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lockstep.checkpoint import Checkpointer
from lockstep.checkpoint.checkpointer import CheckpointAccessError, reading
from lockstep.checkpoint.format import CheckpointError
from lockstep.checkpoint.reader import read_index
from lockstep.checkpoint.train_state import (
    ensure_optimizer_state, model_slots, optimizer_groups, optimizer_slots, rng_state, set_rng_state,
)
from lockstep.config.base import ConfigError, to_dict


def config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted paths whose values differ between two config dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def _resumable(change: str, allowed: Sequence[str]) -> bool:
    """``change`` (a dotted path) lies under one of ``allowed`` (sections or dotted fields)."""
    return any(change == a or change.startswith(a + ".") for a in allowed)


@dataclasses.dataclass
class RankState:
    """A workload's own per-rank state: ``save(step) -> dict`` (JSON) and ``load(state) -> dict``
    (restores it; returns what the manifest's ``resumed`` section adds)."""

    save: Callable[[int], dict] = lambda step: {}
    load: Callable[[dict], dict] = lambda state: {}


class CheckpointPolicy:
    """Every rank of the model's group has one (its shard); the loop calls ``due``/``save``/
    ``records`` each step and ``close`` at the end; ``resume`` once before the first step."""

    def __init__(self, config, run_dir: Path, *, model: nn.Module, optimizer, kind: str,
                 resumable: Sequence[str], rank_state: RankState | None = None,
                 extra_modules: dict[str, nn.Module] | None = None, rank: int = 0, world_size: int = 1,
                 group=None) -> None:
        self.config, self.model, self.optimizer, self.kind = config, model, optimizer, kind
        self.resumable = tuple(resumable)
        self.rank_state = rank_state or RankState()
        self.extra_modules = dict(extra_modules or {})
        self.world_size = world_size
        self.every = config.checkpoint.every
        self.checkpointer: Checkpointer = config.checkpoint.build(run_dir, rank=rank, world_size=world_size,
                                                                  group=group)
        self._slot_cache: dict | None = None
        self.group = group
        self._refused: list[dict] = []
        #: the newest save this run attempted, and the error of each failed one (a full disk, ...)
        self._last_save: int | None = None
        self._failed: dict[int, str] = {}
        if self.every:
            self.checkpointer.prepare(self.slots())

    def slots(self) -> dict:
        """Every saved tensor of this rank. Built once: parameters and optimizer state are updated
        in place for the whole run, so the same views stay valid (and rebuilding costs ~20 ms)."""
        if self._slot_cache is None:
            ensure_optimizer_state(self.optimizer)
            slots = {**model_slots(self.model), **optimizer_slots(self.model, self.optimizer)}
            for name, module in self.extra_modules.items():
                slots.update({f"{name}/" + k.removeprefix("model/"): v for k, v in model_slots(module).items()})
            self._slot_cache = slots
        return self._slot_cache

    def describe(self) -> dict:
        return {"every": self.every, "mode": self.config.checkpoint.mode,
                "storage": self.checkpointer.storage.describe(), "slots": ["model", "optimizer", *self.extra_modules]}

    def resume(self) -> dict:
        """Load the newest checkpoint that verifies (or ``checkpoint.resume_from``) into the slots, RNG
        and the workload's rank state; returns what the manifest records (``from_step``; ``skipped``:
        the newer checkpoints that failed verification, each with its reason and where it was moved).

        A checkpoint that fails (a bad index, a missing or corrupt shard) is skipped for the next older
        one, which is loaded completely -- every slot is written again, then RNG and rank state -- so a
        failed partial load leaves nothing of itself behind. Skipped (and, with ``resume_from``, newer)
        checkpoints are then moved into ``set-aside/`` by rank 0: kept, but no longer counted, pruned,
        or mixed with this run's saves. A config change outside ``resumable`` is a ConfigError, raised
        before the first tensor is touched; an unreadable storage (permissions) is a one-line
        CheckpointError, not a reason to fall back."""
        storage = self.checkpointer.storage
        available = self.checkpointer.complete_steps()
        wanted = self.config.checkpoint.resume_from
        if wanted:
            if wanted not in available:
                raise CheckpointError(f"checkpoint.resume_from: no complete checkpoint at step {wanted} in "
                                      f"{storage.describe()}; available: {_steps(available)}")
            candidates = [wanted]
        else:
            candidates = available[::-1]
            if not candidates:
                raise CheckpointError(f"resume: no complete checkpoint in {storage.describe()}")
        skipped: list[dict] = []
        for step in candidates:
            error, loaded = self._try_load(step)
            if error is None:
                break
            if wanted:
                raise CheckpointError(f"checkpoint.resume_from: the step {wanted} checkpoint in {storage.describe()} "
                                      f"failed verification: {error} (available: {_steps(available)})")
            skipped.append({"step": step, "reason": error})
        else:
            reasons = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped)
            raise CheckpointError(f"resume: no checkpoint in {storage.describe()} verifies ({reasons})")
        step, state, meta = loaded
        set_rng_state(state["rng"])
        extra = self.rank_state.load(state)
        moved = self._set_aside_newer(step, available, skipped)
        return {"from_step": step, "storage": storage.describe(), "saved_world_size": meta.get("world_size"),
                "world_size": self.world_size, **({"skipped": skipped} if skipped else {}),
                **({"set_aside": moved} if moved else {}), **extra}

    def _try_load(self, step: int) -> tuple[str | None, tuple | None]:
        """Check the config of checkpoint ``step`` and load its tensors: (None, what ``load`` returned),
        or (why it failed -- its first line --, None) when it does not verify. A ConfigError propagates
        (every rank reads the same index); an access error (permissions) is raised on every rank."""
        storage = self.checkpointer.storage
        error = access = loaded = None
        try:
            index = reading(storage, f"reading the step {step} index", lambda: read_index(storage, step))
            saved = index.get("metadata", {}).get("config", {})
            changes = [c for c in config_changes(saved, to_dict(self.config)) if not _resumable(c, self.resumable)]
            if changes:  # a changed model would otherwise only list mismatched shapes
                raise ConfigError(f"resume: the checkpoint at step {step} in {storage.describe()} was made with a "
                                  f"different config: {', '.join(changes)} changed (only "
                                  f"{', '.join(self.resumable)} may change)")
            loaded = self.checkpointer.load(self.slots(), step)
        except CheckpointAccessError as err:
            access = str(err)
        except CheckpointError as err:
            error = str(err).splitlines()[0]
            access = self.checkpointer.access_problem(step)  # the reader may have wrapped a PermissionError
        error = self._agreed(error, access)
        return error, (loaded if error is None else None)

    def _agreed(self, error: str | None, access: str | None) -> str | None:
        """Every rank's verdict on one checkpoint: a failure on any rank (its shards) fails it for all,
        and an access error on any rank is raised on all."""
        if self.world_size == 1:
            if access is not None:
                raise CheckpointAccessError(access)
            return error
        verdicts: list = [None] * self.world_size
        dist.all_gather_object(verdicts, (error, access), group=self.group)
        denied = [f"rank {r}: {a}" for r, (_, a) in enumerate(verdicts) if a is not None]
        if denied:
            raise CheckpointAccessError("; ".join(denied))
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e is not None]
        return "; ".join(failed) if failed else None

    def _set_aside_newer(self, step: int, available: list[int], skipped: list[dict]) -> list[str]:
        """Rank 0 moves every checkpoint newer than the one resumed from out of the way: those that
        failed verification and, with ``resume_from``, the newer good ones, which this run's saves
        would otherwise replace or be mixed with. One warning line each."""
        reasons = {s["step"]: s["reason"] for s in skipped}
        moved = []
        for newer in (s for s in available if s > step):
            if self.checkpointer.rank != 0:
                continue
            kind = "corrupt" if newer in reasons else "superseded"
            where = self.checkpointer.set_aside(newer, kind)
            why = (f"failed verification ({reasons[newer]})" if newer in reasons
                   else f"is newer than checkpoint.resume_from={step}")
            warnings.warn(f"checkpoint: step {newer} {why}; moved to {where} (kept, not loaded or pruned); "
                          f"resuming from step {step}", stacklevel=3)
            moved.append(where)
        if self.world_size > 1:  # nobody saves before rank 0 has moved them
            dist.barrier(group=self.group)
        return moved

    def rollback(self, log) -> int | None:
        """Reload model, optimizer (and extra modules) from the newest complete checkpoint, after any
        in-flight save finished (its record goes to ``log``, a sink with ``write``); the RNG and the
        workload's rank state (the loader position) are NOT restored, so the run goes on past the
        batches it just saw. Returns that step, or None when there is none."""
        for record in self.records(wait=True):
            log.write({"step": record.get("checkpoint/step", 0), **record})
        step = self.checkpointer.latest_step()
        if step is None:
            return None
        step, _, _ = self.checkpointer.load(self.slots(), step)
        return step

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == last)

    def nonfinite_slots(self) -> list[str]:
        """The model/extra-module slots of this rank holding a non-finite value, agreed over the ranks
        (any rank's finding counts for all). One fused norm per call: run at save time only."""
        local = {k: getattr(slot.tensor, "_local_tensor", slot.tensor) for k, slot in self.slots().items()
                 if not k.startswith("optimizer/")}
        names = [k for k, t in local.items() if t.is_floating_point() and t.numel()]
        tensors = [local[k].detach() for k in names]
        if not tensors:
            return []
        norms = torch.stack(torch._foreach_norm(tensors))
        bad = ~torch.isfinite(norms)
        if self.world_size > 1:  # every rank must take the same save / refuse decision
            flag = bad.any().to(torch.int32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if bool(flag) and not bool(bad.any()):
                return ["(on another rank)"]
        return [n for n, b in zip(names, bad.tolist()) if b]

    def save(self, step: int) -> bool:
        """Save ``step`` (in the background); refused -- with a warning and a ``checkpoint/refused_step``
        record -- when a model weight is non-finite, so every published checkpoint is finite (and
        pruning, which never deletes the newest one, keeps a finite checkpoint). True when saving."""
        bad = self.nonfinite_slots()
        if bad:
            message = (f"checkpoint at step {step} not saved: non-finite values in {len(bad)} tensor(s) "
                       f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            self._refused.append({"checkpoint/refused_step": step, "checkpoint/refused": message})
            return False
        rank_state = {"rng": rng_state(), "optimizer_groups": optimizer_groups(self.model, self.optimizer),
                      **self.rank_state.save(step)}
        meta = {"family": self.config.model.family, "flavor": self.config.model.flavor, "step": step,
                "world_size": self.world_size, "kind": self.kind,
                "config": json.loads(json.dumps(to_dict(self.config)))}
        self._last_save = step
        self.checkpointer.save(step, self.slots(), rank_state, meta)
        return True

    def records(self, wait: bool = False) -> list[dict]:
        """The metrics records of saves finished since the last call (``wait``: of every save)."""
        done = self.checkpointer.wait() if wait else self.checkpointer.poll()
        refused, self._refused = self._refused, []
        self._failed.update({s.step: s.error for s in done if s.error})
        return refused + [s.record() for s in done]

    def close(self, abandon: bool = False) -> list[dict]:
        """Finish (or abandon) the save in flight and stop the writer. A failed save is reported when it
        happens (a warning, a ``checkpoint/error`` record) and training goes on -- the next save may
        succeed -- but when the run's LAST save failed (a full disk), it ends with a CheckpointError:
        a run never exits as a success without its final checkpoint."""
        done = self.checkpointer.close(abandon=abandon)
        self._failed.update({s.step: s.error for s in done if s.error})
        last = self._last_save
        if not abandon and last is not None and last in self._failed:
            newest = self.checkpointer.latest_step()
            error = CheckpointError(f"the final checkpoint (step {last}) was not saved: {self._failed[last]}; "
                                    f"the newest saved checkpoint is "
                                    f"{'step ' + str(newest) if newest is not None else 'none'} "
                                    f"in {self.checkpointer.storage.describe()}")
            if sys.exc_info()[0] is None:
                raise error
            warnings.warn(str(error), stacklevel=2)  # closing on another error (NonFiniteError...): keep that one
        return [s.record() for s in done]
