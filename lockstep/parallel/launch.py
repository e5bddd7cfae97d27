"""Process-group set-up and tear-down for torchrun jobs (gloo on CPU, NCCL on GPU).

``finish()`` ends a worker with ``destroy_process_group(); os._exit(code)``: processes that built a
DeviceMesh or FSDP otherwise abort at interpreter exit 10-20% of the time on this stack.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` as this process's device (CUDA: the ``LOCAL_RANK``-th GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world_size, device); initialises the default group when WORLD_SIZE > 1: gloo on the
    CPU; on CUDA NCCL for CUDA tensors and gloo beside it for CPU tensors (object collectives, the
    RL transport's host buffers)."""
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
