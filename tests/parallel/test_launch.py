"""Device mapping of torchrun processes (``parallel.launch``) with CUDA mocked: GPU = LOCAL_RANK %
device_count, and a group that needs NCCL refuses ranks sharing a GPU with a ConfigError naming
``training.device`` (an RL job's generator may share the trainer's GPU: its groups are gloo)."""

from __future__ import annotations

import socket

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.parallel import launch


def _gpus(monkeypatch, count: int, local_rank: int | None = None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))


@pytest.mark.parametrize("count, local_rank, want", [
    (1, None, 0), (1, 0, 0), (1, 1, 0),  # a generator beside the trainer on a one-GPU machine: cuda:0, not cuda:1
    (2, 1, 1), (2, 3, 1), (4, 2, 2), (8, 9, 1),
])
def test_cuda_device_is_local_rank_modulo_gpu_count(monkeypatch, count, local_rank, want):
    _gpus(monkeypatch, count, local_rank)
    assert launch.resolve_device("cuda") == torch.device("cuda", want)
    assert launch.resolve_device("auto") == torch.device("cuda", want)


def test_cpu_and_missing_cuda(monkeypatch):
    _gpus(monkeypatch, 0, 3)
    assert launch.resolve_device("auto") == torch.device("cpu")
    assert launch.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^training\.device: 'cuda' was asked for, but .* sees no CUDA device"):
        launch.resolve_device("cuda")
    with pytest.raises(ConfigError, match=r"^--device: "):
        launch.resolve_device("cuda", field="--device")


def test_shared_gpu_finds_the_first_clash():
    placement = [("a", 0), ("a", 1), ("a", 0), ("b", 0), ("a", -1), ("a", -1)]
    assert launch.shared_gpu(placement, [0, 1]) is None
    assert launch.shared_gpu(placement, [0, 3]) is None  # same index, other host
    assert launch.shared_gpu(placement, [4, 5]) is None  # off the GPU: never a clash
    assert launch.shared_gpu(placement, [1, 0, 2]) == (0, 2, "a", 0)


def _job(monkeypatch, placement):
    """A mocked process group whose ranks sit at ``placement`` (host, GPU index)."""
    gathers = []

    def all_gather_object(out, obj, group=None):
        gathers.append(obj)
        out[:] = placement

    monkeypatch.setattr(launch.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch.dist, "get_world_size", lambda group=None: len(placement))
    monkeypatch.setattr(launch.dist, "all_gather_object", all_gather_object)
    return gathers


def test_nccl_group_on_one_gpu_is_refused_naming_training_device(monkeypatch):
    _gpus(monkeypatch, 1, 0)
    # an RL job on one GPU: trainer rank 0 and generator rank 1 both on cuda:0
    gathers = _job(monkeypatch, [("host", 0), ("host", 0)])
    dev = launch.resolve_device("cuda")
    launch.check_one_gpu_per_rank([0], dev)  # a one-rank trainer: its group never needs two GPUs
    launch.check_one_gpu_per_rank([0, 1], torch.device("cpu"))  # gloo: no constraint
    assert gathers == []  # nothing to gather for those
    with pytest.raises(ConfigError, match=r"^training\.device: ranks 0 and 1 of the trainer .* share GPU 0 on host"
                                          r".* NCCL.* or set training\.device=cpu"):
        launch.check_one_gpu_per_rank([0, 1], dev, "the trainer")
    assert gathers == [(socket.gethostname(), 0)]  # this process's (host, GPU)


def test_nccl_group_with_a_gpu_each_passes(monkeypatch):
    _gpus(monkeypatch, 2, 1)
    # two trainer ranks on GPUs 0 and 1, two generators sharing them
    gathers = _job(monkeypatch, [("host", 0), ("host", 1), ("host", 0), ("host", 1)])
    dev = launch.resolve_device("cuda")
    assert dev == torch.device("cuda", 1)
    launch.check_one_gpu_per_rank([0, 1], dev)
    assert gathers == [(socket.gethostname(), 1)]
    with pytest.raises(ConfigError, match="ranks 1 and 3"):
        launch.check_one_gpu_per_rank([0, 1, 3], dev)
