"""``run_rl(config)``: one RL job, as the trainer (rank 0) or a generator (ranks 1..N).

With ``workers.generators = N >= 1`` the job is ``N + 1`` torchrun processes (``lockstep rl``
launches them): rank 0 trains, ranks 1..N generate; weights go trainer -> generators over one
gloo/NCCL group, rollouts generator -> trainer over another. With ``generators = 0`` one process
generates between its own steps with the very modules it trains (no copy, no sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lockstep.config.base import ConfigError
from lockstep.parallel.launch import init_distributed, world_size_from_env
from lockstep.rl.config import RLConfig
from lockstep.rl.policy import load_policy, with_stop_ids
from lockstep.train.trainer import seed_everything


def check_world(config: RLConfig, world: int) -> None:
    expected = config.workers.world_size
    if world != expected:
        raise ConfigError(f"workers.generators: {config.workers.generators} generator(s) + 1 trainer need "
                          f"{expected} processes, but this job has {world} (`lockstep rl` starts the right number; "
                          f"with torchrun use --nproc-per-node {expected})")


def run_rl(config: RLConfig):
    """Run the job this process belongs to; the trainer returns an ``RLResult``, generators None."""
    config.validate()
    check_world(config, world_size_from_env())
    rank, world, _ = init_distributed()
    config.numerics.build()
    threads = config.training.threads if rank == 0 else config.workers.generator_threads
    if threads:
        torch.set_num_threads(threads)
    seed_everything(config.seed)
    policy = load_policy(config)
    run_config = with_stop_ids(config, policy)
    sync_group = rollout_group = None
    if world > 1:
        sync_group = dist.new_group(backend="gloo")  # CPU tensors: the model lives on the CPU here
        rollout_group = dist.new_group(backend="gloo")
    if rank > 0:
        from lockstep.rl.generator import run_generator

        run_generator(run_config, policy, rank=rank, sync_group=sync_group, rollout_group=rollout_group)
        return None
    from lockstep.rl.trainer import RLTrainer

    try:
        trainer = RLTrainer(config, run_config, policy, sync_group=sync_group, rollout_group=rollout_group)
    except Exception as err:
        if sync_group is not None:  # let the generators leave instead of waiting for weights forever
            dist.broadcast_object_list([{"error": str(err)}], src=0, group=sync_group)
        raise
    return trainer.run()
