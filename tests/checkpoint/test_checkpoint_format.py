"""Checkpointer unit tests in one process: round trip, format, pruning, corruption and mismatch errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lockstep.checkpoint import Checkpointer, CheckpointError, LocalStorage, Slot, latest_step
from lockstep.checkpoint.reader import read_full_state


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(300, 70, generator=g),
        "model/b": torch.randn(33, generator=g).bfloat16(),
        "model/count": torch.arange(5, dtype=torch.int64),
        "model/mask": torch.tensor([True, False, True]),
        "optimizer/w/step": torch.tensor(7.0),
    }


def _slots(tensors):
    return {k: Slot.of(v) for k, v in tensors.items()}


def _zeros_like(tensors):
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_round_trip_is_exact_for_every_dtype(tmp_path, mode):
    state = _state()
    ck = Checkpointer(LocalStorage(tmp_path), mode=mode)
    ck.save(5, _slots(state), {"rng": [1, 2]}, {"family": "test"})
    (stats,) = ck.wait()
    assert stats.error is None and stats.bytes > 300 * 70 * 4 and stats.blocking_ms > 0
    ck.close()
    target = _zeros_like(state)
    step, rank_state, meta = Checkpointer(LocalStorage(tmp_path), mode="sync").load(_slots(target))
    assert (step, rank_state, meta) == (5, {"rng": [1, 2]}, {"family": "test"})
    for k in state:
        assert torch.equal(target[k], state[k]), k


def test_files_are_plain_safetensors_with_a_checksummed_index(tmp_path):
    state = _state()
    ck = Checkpointer(LocalStorage(tmp_path), mode="sync", max_file_bytes=40_000)
    ck.save(1, _slots(state), {}, {})
    step_dir = tmp_path / "step-00000001"
    index = json.loads((step_dir / "index.json").read_text())
    shards = sorted(p.name for p in step_dir.glob("*.safetensors"))
    assert len(shards) >= 2  # 84 kB of weights cut at 40 kB
    loaded = {}
    for name in shards:
        loaded.update(load_file(step_dir / name))  # readable by safetensors itself
        assert index["files"][name]["bytes"] == (step_dir / name).stat().st_size
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    assert index["tensors"]["model/w"]["shape"] == [300, 70]
    assert index["tensors"]["model/b"]["dtype"] == "bfloat16"
    assert (tmp_path / "latest").read_text() == "step-00000001"


def test_keeps_the_newest_k_and_latest_points_at_the_last(tmp_path):
    state = _state()
    ck = Checkpointer(LocalStorage(tmp_path), mode="sync", keep=2)
    for step in (1, 2, 3, 4):
        state["model/w"].add_(1)
        ck.save(step, _slots(state), {}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    step, tensors, _ = read_full_state(LocalStorage(tmp_path))
    assert step == 4 and torch.equal(tensors["model/w"], state["model/w"])


def test_incomplete_saves_are_invisible_and_cleaned(tmp_path):
    state = _state()
    Checkpointer(LocalStorage(tmp_path), mode="sync").save(1, _slots(state), {}, {})
    partial = tmp_path / "step-00000002.partial"
    partial.mkdir()
    (partial / "rank-00000-0.safetensors").write_bytes(b"half a file")
    assert latest_step(LocalStorage(tmp_path)) == 1
    with pytest.warns(UserWarning, match="removed incomplete saves"):
        Checkpointer(LocalStorage(tmp_path), mode="sync")
    assert not partial.exists()


def test_latest_marker_damage_falls_back_to_the_newest_complete(tmp_path):
    state = _state()
    ck = Checkpointer(LocalStorage(tmp_path), mode="sync")
    ck.save(1, _slots(state), {}, {})
    ck.save(2, _slots(state), {}, {})
    (tmp_path / "latest").write_text("step-00000009")
    assert latest_step(LocalStorage(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_a_damaged_shard_is_named_in_the_error(tmp_path, damage):
    state = _state()
    Checkpointer(LocalStorage(tmp_path), mode="sync").save(1, _slots(state), {}, {})
    shard = tmp_path / "step-00000001" / "rank-00000-0.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) - 100] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00000-0.safetensors: corrupt checkpoint file"):
        Checkpointer(LocalStorage(tmp_path), mode="sync").load(_slots(_zeros_like(state)))


def test_another_model_is_refused_with_the_mismatched_tensors(tmp_path):
    state = _state()
    Checkpointer(LocalStorage(tmp_path), mode="sync").save(1, _slots(state), {}, {"family": "llama3",
                                                                                  "flavor": "debug"})
    other = {"model/w": torch.zeros(300, 71), "model/b": torch.zeros(33), "model/extra": torch.zeros(2),
             "optimizer/w/step": torch.tensor(0.0)}
    with pytest.raises(CheckpointError) as err:
        Checkpointer(LocalStorage(tmp_path), mode="sync").load(_slots(other))
    text = str(err.value)
    assert "saved from llama3 debug" in text
    assert "model/extra" in text  # missing from the checkpoint
    assert "model/count" in text and "model/mask" in text  # not in the model
    assert "model/w: saved float32[300, 70], model float32[300, 71]" in text
    assert "model/b: saved bfloat16[33], model float32[33]" in text


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Checkpointer(LocalStorage(tmp_path), mode="sync").load(_slots(_state()))


def test_saves_do_not_see_later_changes_to_the_state(tmp_path):
    """The staging copy is taken in save(): training on while the writer writes changes nothing."""
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    ck = Checkpointer(LocalStorage(tmp_path), mode="process")
    ck.save(1, _slots(state), {}, {})
    state["model/w"].mul_(-3)  # the next optimizer step, before the write finished
    ck.close()
    _, tensors, _ = read_full_state(LocalStorage(tmp_path))
    assert torch.equal(tensors["model/w"], expected["model/w"])


class SlowStorage(LocalStorage):
    """Local storage whose writes take a while, so a test can act during one."""

    def put(self, key, chunks):
        import time

        time.sleep(0.3)
        super().put(key, chunks)


def test_a_writer_killed_mid_save_loses_only_that_save(tmp_path):
    state = _state()
    ck = Checkpointer(SlowStorage(tmp_path), mode="process")
    ck.save(1, _slots(state), {}, {})
    assert ck.wait()[0].error is None
    ck.save(2, _slots(state), {}, {})
    os.kill(ck.writer_pid, 9)  # mid-save: the first shard write sleeps 0.3 s
    with pytest.warns(UserWarning, match="writer process died"):
        (stats,) = ck.wait()
    assert stats.step == 2 and "died" in stats.error
    assert latest_step(LocalStorage(tmp_path)) == 1  # the previous checkpoint is intact and loads
    read_full_state(LocalStorage(tmp_path))
    ck.save(3, _slots(state), {}, {})  # a fresh writer takes over
    assert [s.error for s in ck.wait()] == [None]
    ck.close()
    assert latest_step(LocalStorage(tmp_path)) == 3


def test_an_idle_dead_writer_is_replaced_silently(tmp_path):
    state = _state()
    ck = Checkpointer(LocalStorage(tmp_path), mode="process")
    os.kill(ck.writer_pid, 9)
    ck._proc.join()
    ck.save(1, _slots(state), {}, {})
    assert [s.error for s in ck.wait()] == [None]
    ck.close()
    assert latest_step(LocalStorage(tmp_path)) == 1


def test_staging_buffers_of_dead_processes_are_freed():
    from multiprocessing import resource_tracker, shared_memory

    from lockstep.checkpoint import shm

    dead = subprocess_pid_that_exited()
    name = f"{shm.PREFIX}{shm._pid_namespace()}-{dead}-deadbeef"
    seg = shared_memory.SharedMemory(name=name, create=True, size=4096)
    seg.close()
    resource_tracker.unregister(seg._name, "shared_memory")  # as if its creator had been killed
    mine = shm.create_segment(4096)  # a live process's buffer must survive
    try:
        assert name in shm.remove_stale_segments()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
        assert os.path.exists(os.path.join(shm.SHM_DIR, mine.name))
    finally:
        mine.close()
        mine.unlink()


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
