"""Checkpoints on an S3-compatible object store: a moto server on loopback, started by the test.

The same guarantees as on a local disk, with S3's semantics: objects are written in place and a
checkpoint is complete only once its index (written last, after every rank's part) exists; a
save cut short leaves no index, so it is invisible and the next run deletes it.
"""

import os
import subprocess
import sys

import boto3  # the s3 extra; `make test` installs it with moto[server]
import moto.server as moto_server
import pytest
import torch

from lockstep.checkpoint import Checkpointer, S3Storage
from lockstep.checkpoint.checkpointer import latest_step
from lockstep.checkpoint.format import CheckpointError
from lockstep.checkpoint.layout import Slot
from lockstep.checkpoint.reader import read_full_state
from lockstep.checkpoint.storage import storage_from_uri

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "lockstep-test", "AWS_SECRET_ACCESS_KEY": "lockstep-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def endpoint():
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    yield url
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _bucket(endpoint: str, name: str) -> str:
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(64, 33, generator=g), "model/b": torch.randn(7, generator=g).bfloat16(),
            "optimizer/w/step": torch.tensor(3.0), "model/ids": torch.arange(10)}


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_round_trip_on_s3_is_exact(endpoint, mode):
    storage = S3Storage(_bucket(endpoint, f"rt-{mode}"), "runs/a", endpoint_url=endpoint)
    state = _state()
    ckpt = Checkpointer(storage, keep=2, mode=mode, max_file_bytes=4096)
    for step in (1, 2, 3):
        ckpt.save(step, {n: Slot.of(t) for n, t in state.items()}, {"step": step}, {"family": "test"})
    stats = ckpt.wait()
    ckpt.close()
    assert all(s.error is None for s in stats)
    assert latest_step(storage) == 3
    assert storage.list_dir("") == ["latest", "step-00000002", "step-00000003"]  # keep=2 pruned step 1
    assert len([n for n in storage.list_dir("step-00000003") if n.endswith(".safetensors")]) > 1  # 4 KB shards
    step, tensors, meta = read_full_state(storage)
    assert step == 3 and meta["family"] == "test"
    assert tensors.keys() == state.keys() and all(torch.equal(tensors[k], state[k]) for k in state)


def test_incomplete_save_on_s3_is_invisible_and_set_aside(endpoint):
    storage = S3Storage(_bucket(endpoint, "incomplete"), "", endpoint_url=endpoint)
    ckpt = Checkpointer(storage, mode="sync")
    ckpt.save(1, {n: Slot.of(t) for n, t in _state().items()}, {}, {})
    ckpt.close()
    # a save cut off before its index: shards present, no index.json
    storage.put("step-00000002/rank-00000-0.safetensors", [b"partial"])
    assert latest_step(storage) == 1
    with pytest.warns(UserWarning, match="moved aside, kept, not loaded: step-00000002 has no index.json"):
        Checkpointer(storage, mode="sync").close()  # a new run moves it out of the way, never deletes it
    assert "step-00000002" not in storage.list_dir("")
    (aside,) = storage.list_dir("set-aside")
    assert aside.startswith("step-00000002.incomplete-")
    assert storage.get(f"set-aside/{aside}/rank-00000-0.safetensors") == b"partial"


def test_corrupt_object_on_s3_is_named(endpoint):
    storage = S3Storage(_bucket(endpoint, "corrupt"), "p", endpoint_url=endpoint)
    ckpt = Checkpointer(storage, mode="sync")
    ckpt.save(5, {n: Slot.of(t) for n, t in _state().items()}, {}, {})
    ckpt.close()
    shard = next(n for n in storage.list_dir("step-00000005") if n.endswith(".safetensors"))
    data = bytearray(storage.get(f"step-00000005/{shard}"))
    data[-1] ^= 0x01
    storage.put(f"step-00000005/{shard}", [bytes(data)])
    with pytest.raises(CheckpointError, match=f"s3://corrupt/p/step-00000005/{shard}"):
        read_full_state(storage)


def test_storage_uri_errors_name_the_field():
    with pytest.raises(ValueError, match="checkpoint.storage: .* names no bucket"):
        storage_from_uri("s3:///x")
    with pytest.raises(ValueError, match="checkpoint.storage: unsupported scheme"):
        storage_from_uri("gs://bucket/x")


@pytest.mark.slow
def test_trainer_saves_and_resumes_from_s3(endpoint, tmp_path):
    _bucket(endpoint, "train")
    env = {**os.environ, **CREDENTIALS, "OMP_NUM_THREADS": "1"}
    common = [sys.executable, "-m", "lockstep.cli", "train", "--recipe", "debug", "--steps", "4",
              "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "2",
              "--checkpoint.storage", "s3://train/runs/r1", "--checkpoint.endpoint-url", endpoint,
              "--output.no-progress", "--output.sample-tokens", "0", "--output.no-parity-check"]
    first = subprocess.run([*common, "--stop-after", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    storage = S3Storage("train", "runs/r1", endpoint_url=endpoint)
    assert latest_step(storage) == 2
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing went to local disk
    second = subprocess.run([*common, "--resume"], capture_output=True, text=True, timeout=180, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "from the step 2 checkpoint" in second.stdout
    assert "s3://train/runs/r1" in second.stdout
    assert latest_step(storage) == 4
