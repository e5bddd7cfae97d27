"""The one-pass verified shard read (lockstep/checkpoint/reader.py): chunks read straight into
slots or through a scratch tensor, sha256 computed while reading, and every kind of damage to a
shard (data, header length, header JSON, offsets, a tensor dropped) an error naming the file."""

import hashlib
import json
import struct

import pytest
import torch

from lockstep.checkpoint import Checkpointer, CheckpointError, LocalStorage, Slot
from lockstep.checkpoint import reader

SHARD = "rank-00000-0.safetensors"


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(40, 6, generator=g), "model/v": torch.randn(9, generator=g).bfloat16(),
            "model/ids": torch.arange(7, dtype=torch.int64)}


def _save(tmp_path, state):
    Checkpointer(LocalStorage(tmp_path), mode="sync").save(1, {k: Slot.of(v) for k, v in state.items()}, {}, {})
    return tmp_path / "step-00000001" / SHARD


def _load(tmp_path, slots):
    return Checkpointer(LocalStorage(tmp_path), mode="sync").load(slots)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(reader, "PIECE", 64)  # many pieces per chunk: the piecewise read and hash are exercised


def test_direct_and_scratch_reads_are_bitwise(tmp_path):
    state = _state()
    _save(tmp_path, state)
    whole = {k: torch.full_like(v, 3) for k, v in state.items()}  # every chunk lands straight in its slot
    _load(tmp_path, {k: Slot.of(v) for k, v in whole.items()})
    assert all(torch.equal(whole[k], state[k]) for k in state)
    # rows 10..25 of w (a chunk larger than the slot: scratch + copy), w^T's storage (not contiguous)
    part = torch.zeros(15, 6)
    transposed = torch.zeros(6, 40).t()
    for w_slot in (Slot.row_slice(part, 40, 10), Slot.of(transposed)):
        _load(tmp_path, {"model/w": w_slot, "model/v": Slot.of(torch.zeros(9, dtype=torch.bfloat16)),
                         "model/ids": Slot.of(torch.zeros(7, dtype=torch.int64))})
    assert torch.equal(part, state["model/w"][10:25]) and torch.equal(transposed, state["model/w"])


def test_a_storage_without_open_read_is_read_through_get(tmp_path):
    state = _state()
    _save(tmp_path, state)

    class GetOnly:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "open_read":
                raise AttributeError(name)
            return getattr(self.inner, name)

    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader.read_checkpoint(GetOnly(LocalStorage(tmp_path)), 1, {k: Slot.of(v) for k, v in target.items()}, 0)
    assert all(torch.equal(target[k], state[k]) for k in state)


def _rewrite(shard, data: bytes, fix_index: bool) -> None:
    """Write damaged bytes; with ``fix_index`` the index's size and sha256 are updated to match, so
    only the structural checks stand between the damage and the model."""
    shard.write_bytes(data)
    if fix_index:
        index_path = shard.parent / "index.json"
        index = json.loads(index_path.read_text())
        index["files"][shard.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        index_path.write_text(json.dumps(index))


def _with_header(data: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    meta = edit(json.loads(data[8:8 + n]))
    raw = json.dumps(meta).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def _drop_w(meta):
    del meta["model/w"]
    return meta


def _stretch_w(meta):
    meta["model/w"]["data_offsets"][1] += 4
    return meta


def _huge_w(meta):
    meta["model/w"]["data_offsets"] = [0, 24 * 10 ** 7]  # consistent with its shape, but 240 MB
    meta["model/w"]["shape"] = [10 ** 7, 6]
    return meta


@pytest.mark.parametrize("damage,fix_index,message", [
    ("flip a byte of w's data", False, "sha256 .* does not match"),
    ("flip the header length", False, "corrupt checkpoint file"),
    ("flip a header byte", False, "corrupt checkpoint file"),
    ("header length beyond the file", True, "not a safetensors file"),
    ("header not JSON", True, "unreadable safetensors header"),
    ("w's offsets cover too many bytes", True, "unreadable safetensors header"),
    ("w's bytes lie outside the file", True, "outside the file"),
    ("w dropped from the header", True, "tensor model/w listed in the index is missing"),
])
def test_damage_is_an_error_naming_the_file(tmp_path, damage, fix_index, message):
    state = _state()
    shard = _save(tmp_path, state)
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if damage == "flip a byte of w's data":
        data[8 + n + 100] ^= 0x04  # w is the widest dtype: first in the data
    elif damage == "flip the header length":
        data[1] ^= 0x01
    elif damage == "flip a header byte":
        data[8 + n // 2] ^= 0x20
    elif damage == "header length beyond the file":
        data[:8] = struct.pack("<Q", len(data))
    elif damage == "header not JSON":
        data[8] = ord("#")
    elif damage == "w's offsets cover too many bytes":
        data = bytearray(_with_header(bytes(data), _stretch_w))
    elif damage == "w's bytes lie outside the file":
        data = bytearray(_with_header(bytes(data), _huge_w))
    else:
        data = bytearray(_with_header(bytes(data), _drop_w))
    _rewrite(shard, bytes(data), fix_index)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CheckpointError, match=f"step-00000001/{SHARD}: .*{message}"):
        _load(tmp_path, {k: Slot.of(v) for k, v in target.items()})
