"""Process-group set-up and tear-down for torchrun jobs (gloo on CPU, NCCL on GPU).

Devices: process ``LOCAL_RANK`` of a node uses GPU ``LOCAL_RANK % torch.cuda.device_count()``, so
a job with more processes than GPUs (an RL job's generator beside its trainer on a one-GPU machine)
shares GPUs instead of asking for one that is not there. NCCL refuses two ranks of one group on
one GPU, so groups whose ranks may share a GPU carry CPU tensors over gloo (the RL weight-sync and
rollout groups; object collectives of the default group), and a group that needs NCCL (the
trainer's runtime: FSDP, gradient and metric reductions on CUDA tensors) is checked by
:func:`check_one_gpu_per_rank`, which raises a ConfigError naming ``training.device``.

``finish()`` ends a worker with ``destroy_process_group(); os._exit(code)``: processes that built a
DeviceMesh or FSDP otherwise abort at interpreter exit 10-20% of the time on this stack.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.config.base import ConfigError


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK``; 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(name: str = "auto", field: str = "training.device") -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` as this process's device. CUDA: GPU ``LOCAL_RANK % device_count``
    (processes beyond the node's GPU count share them); a ConfigError naming ``field`` when CUDA is
    asked for and torch sees no GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 1:
            raise ConfigError(f"{field}: 'cuda' was asked for, but torch {torch.__version__} sees no CUDA device; "
                              "use 'auto' or 'cpu'")
        return torch.device("cuda", local_rank() % count)
    return torch.device(name)


def gpu_placement(device: torch.device) -> list[tuple[str, int]]:
    """``(hostname, GPU index)`` of every rank of the default group, by global rank (index -1: not on
    a GPU), with one object collective (CPU, gloo): every process must call it."""
    mine = (socket.gethostname(), device.index if device.type == "cuda" else -1)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [tuple(p) for p in everyone]


def shared_gpu(placement: Sequence[tuple[str, int]], ranks: Sequence[int]) -> tuple[int, int, str, int] | None:
    """The first two of ``ranks`` placed on one GPU, as ``(rank_a, rank_b, host, gpu)``; None when
    every one of them has a GPU of its own (ranks off the GPU, index -1, never clash)."""
    seen: dict[tuple[str, int], int] = {}
    for r in ranks:
        host, gpu = placement[r]
        if gpu < 0:
            continue
        if (host, gpu) in seen:
            return seen[(host, gpu)], r, host, gpu
        seen[(host, gpu)] = r
    return None


def check_one_gpu_per_rank(ranks: Sequence[int], device: torch.device, what: str = "the trainer",
                           field: str = "training.device") -> None:
    """Refuse a group of ``ranks`` that needs NCCL (CUDA collectives) when two of them share a GPU,
    with a ConfigError naming ``field``. Every rank raises the same error (no rank is left waiting).
    A no-op off CUDA, for one rank and outside a process group; else collective over the default
    group (every process must call it, with the same ``ranks``)."""
    if device.type != "cuda" or len(ranks) < 2 or not dist.is_initialized():
        return
    clash = shared_gpu(gpu_placement(device), ranks)
    if clash is not None:
        a, b, host, gpu = clash
        raise ConfigError(
            f"{field}: ranks {a} and {b} of {what} ({len(ranks)} processes) would share GPU {gpu} on {host} "
            f"({torch.cuda.device_count()} GPU(s) there: a process uses GPU LOCAL_RANK % GPUs), and NCCL, "
            "which carries the group's CUDA collectives, refuses two ranks of one group on one GPU; give "
            "each of these processes its own GPU (fewer processes per node, or more GPUs), or set "
            f"{field}=cpu (gloo)")


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world_size, device); initialises the default group when WORLD_SIZE > 1: gloo on the
    CPU; on CUDA NCCL for CUDA tensors and gloo beside it for CPU tensors (object collectives, the
    RL transport's host buffers). NCCL communicators start lazily, with a group's first CUDA
    collective: ranks sharing a GPU are fine as long as no group of them runs one (see the module
    docstring and ``check_one_gpu_per_rank``)."""
    world = world_size_from_env()
    dev = resolve_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend=backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, dev


def finish(code: int = 0) -> None:
    """Leave a distributed worker cleanly (see module docstring); a no-op for one process."""
    if dist.is_initialized():
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def relaunch_with_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``lockstep <argv>`` as ``nproc`` local torchrun workers; returns their exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "lockstep.cli", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(command, env=env)
