"""``run_rl(config)``: one RL job, as the trainer (rank 0) or a generator (ranks 1..N).

With ``workers.generators = N >= 1`` the job is ``T + N`` torchrun processes (``lockstep rl``
launches them): ranks 0..T-1 train (``parallel``: FSDP2/HSDP, TP, EP over them), ranks T.. generate;
weights go trainer rank 0 -> generators over one gloo group per generator, rollouts generator -> trainer
rank 0 over another (:mod:`lockstep.rl.layout`), heartbeats over a socket of their own
(:mod:`lockstep.rl.liveness`); the trainer ranks run on a ``ParallelRuntime`` of their own. With ``generators = 0`` one process
generates between its own steps with the very modules it trains (no copy, no sync).
"""

from __future__ import annotations

import torch

from lockstep.config.base import ConfigError
from lockstep.parallel.launch import init_distributed, world_size_from_env
from lockstep.rl.config import RLConfig
from lockstep.rl.layout import create_layout
from lockstep.rl.policy import load_policy, with_stop_ids
from lockstep.run import seed_everything


def check_world(config: RLConfig, world: int) -> None:
    expected = config.world_size
    if world != expected:
        raise ConfigError(f"workers.generators: {config.trainer_world_size} trainer + {config.workers.generators} "
                          f"generator(s) of {config.workers.generator_parallel.size} process(es) make {expected}, but "
                          f"this job has {world} (`lockstep rl` starts "
                          f"the right number; with torchrun use --nproc-per-node {expected})")


def run_rl(config: RLConfig):
    """Run the job this process belongs to; trainer rank 0 returns an ``RLResult``, others None."""
    config.validate()
    check_world(config, world_size_from_env())
    rank, world, _ = init_distributed(config.training.device)
    config.numerics.build()
    layout = create_layout(config, rank, world)
    threads = config.training.threads if layout.is_trainer else config.workers.generator_threads
    if threads:
        torch.set_num_threads(threads)
    seed_everything(config.seed)
    policy = load_policy(config)
    run_config = with_stop_ids(config, policy)
    if not layout.is_trainer:
        from lockstep.rl.generator import run_generator

        run_generator(run_config, policy, layout)
        return None
    from lockstep.rl.trainer import RLTrainer

    try:
        trainer = RLTrainer(config, run_config, policy, layout)
    except Exception as err:
        if rank == 0 and layout.liveness is not None:  # let the generators leave instead of waiting forever
            layout.liveness.send_start({"error": str(err)})
            layout.liveness.finish()
        raise
    return trainer.run()
