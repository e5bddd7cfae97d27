"""Reading a checkpoint into this rank's tensors, whatever layout saved it.

The index is checked against the target first (names, global shapes, dtypes: one error listing
every mismatch), then each needed shard is read, its size and sha256 verified, and the overlap of
every saved chunk with every local slot copied in. Coverage is counted: a target element no
chunk provides is an error, not a silently uninitialised weight.
"""

from __future__ import annotations

import json
import math

from lockstep.checkpoint.dtypes import DTYPE_NAMES, DTYPES_BY_NAME
from lockstep.checkpoint.format import (
    FORMAT, INDEX, CheckpointError, load_safetensors, rank_state_file, step_dir, verified_bytes,
)
from lockstep.checkpoint.layout import Slot, copy_overlap


def read_index(storage, step: int) -> dict:
    key = f"{step_dir(step)}/{INDEX}"
    try:
        index = json.loads(storage.get(key))
    except FileNotFoundError:
        raise CheckpointError(f"{storage.describe()}/{key}: no such checkpoint (incomplete or deleted)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{storage.describe()}/{key}: unreadable checkpoint index: {err}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{storage.describe()}/{key}: not a lockstep checkpoint index")
    return index


def _mismatches(index: dict, slots: dict[str, Slot], job_names: set[str]) -> list[str]:
    saved = index["tensors"]
    problems = []
    missing = sorted(set(slots) - set(saved))
    unexpected = sorted(set(saved) - job_names)
    if missing:
        problems.append(f"{len(missing)} tensors the model needs are not in the checkpoint: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensors the model does not have: {_few(unexpected)}")
    wrong = []
    for name in sorted(set(slots) & set(saved)):
        slot, entry = slots[name], saved[name]
        if tuple(entry["shape"]) != slot.global_shape or entry["dtype"] != DTYPE_NAMES[slot.tensor.dtype]:
            wrong.append(f"{name}: saved {entry['dtype']}{list(entry['shape'])}, "
                         f"model {DTYPE_NAMES[slot.tensor.dtype]}{list(slot.global_shape)}")
    if wrong:
        problems.append(f"{len(wrong)} tensors differ in shape or dtype: " + _few(wrong))
    return problems


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def read_checkpoint(storage, step: int, slots: dict[str, Slot], rank: int,
                    job_names: set[str] | None = None) -> tuple[dict, dict]:
    """Fill ``slots`` from checkpoint ``step``; returns (rank state, metadata).

    ``job_names`` is every tensor name any rank of the job holds (pipeline stages hold disjoint
    parts); a checkpoint tensor no rank holds is reported as unexpected. Defaults to ``slots``."""
    index = read_index(storage, step)
    where = f"{storage.describe()}/{step_dir(step)}"
    problems = _mismatches(index, slots, set(slots) if job_names is None else job_names)
    if problems:
        meta = index.get("metadata", {})
        saved_model = f" (saved from {meta.get('family')} {meta.get('flavor')})" if meta.get("family") else ""
        raise CheckpointError(f"{where}: checkpoint does not match this model{saved_model}:\n  - "
                              + "\n  - ".join(problems))
    needed: dict[str, list[tuple[str, dict]]] = {}
    for name, slot in slots.items():
        for chunk in index["tensors"][name]["chunks"]:
            if slot.tensor.ndim == 0 or _intersects(slot, chunk):
                needed.setdefault(chunk["file"], []).append((name, chunk))
    covered = {name: 0 for name in slots}
    for file, chunks in sorted(needed.items()):
        if file not in index["files"]:
            raise CheckpointError(f"{where}/{INDEX}: names shard {file} without a checksum")
        data = verified_bytes(storage, f"{step_dir(step)}/{file}", index["files"][file])
        tensors = load_safetensors(data, f"{where}/{file}")
        for name, chunk in chunks:
            if name not in tensors:
                raise CheckpointError(f"{where}/{file}: tensor {name} listed in the index is missing")
            covered[name] += copy_overlap(slots[name], tensors[name], tuple(chunk["offsets"]))
    short = [n for n, c in covered.items() if c < math.prod(slots[n].shape)]
    if short:
        raise CheckpointError(f"{where}: the saved chunks do not cover {_few(short)} (damaged index)")
    state_file = rank_state_file(rank)
    if state_file not in index["files"]:
        state_file = rank_state_file(0)  # a run with fewer ranks saved this one: rank 0's state is global
    rank_state = json.loads(verified_bytes(storage, f"{step_dir(step)}/{state_file}", index["files"][state_file]))
    return rank_state["state"], index.get("metadata", {})


def _intersects(slot: Slot, chunk: dict) -> bool:
    return all(max(a, b) < min(a + n, b + m)
               for a, n, b, m in zip(slot.offsets, slot.shape, chunk["offsets"], chunk["shape"]))


def read_full_state(storage, step: int | None = None) -> tuple[int, dict, dict]:
    """Every tensor of a checkpoint, unsharded, in one process: (step, {name: tensor}, metadata).
    For inspection, export and tests; checks every shard's checksum on the way."""
    import torch

    from lockstep.checkpoint.checkpointer import latest_step

    if step is None:
        step = latest_step(storage)
        if step is None:
            raise CheckpointError(f"{storage.describe()}: no complete checkpoint to load")
    index = read_index(storage, step)
    tensors = {name: torch.empty(entry["shape"], dtype=DTYPES_BY_NAME[entry["dtype"]])
               for name, entry in index["tensors"].items()}
    read_checkpoint(storage, step, {n: Slot.of(t) for n, t in tensors.items()}, rank=0)
    return step, tensors, index.get("metadata", {})
