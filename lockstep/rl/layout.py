"""Who is who in an RL job, and the process groups between them.

Ranks ``0 .. T-1`` are the trainer (``T = parallel.dp_replicate x parallel.dp_shard``): a
:class:`~lockstep.parallel.runtime.ParallelRuntime` over those ranks only (its own DeviceMesh and
group; FSDP2/HSDP over them by the same plan pretraining uses). Ranks ``T .. T+N-1`` are the
generators. Groups (every rank creates every group, in the same order, as ``new_group`` requires):

- the runtime's group (``trainer_group``): the trainer ranks (a step's episodes are broadcast to
  them, metrics reduced);
- ``sync_group``: trainer rank 0 + the generators (weight broadcasts);
- ``rollout_group``: trainer rank 0 + the generators (rollouts, point to point).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from lockstep.parallel.runtime import ParallelRuntime
from lockstep.rl.config import RLConfig


@dataclasses.dataclass
class RLLayout:
    rank: int
    world_size: int
    trainer_world: int
    n_generators: int
    #: the trainer ranks' runtime (None on generator ranks)
    runtime: ParallelRuntime | None = None
    trainer_group: object | None = None
    sync_group: object | None = None
    rollout_group: object | None = None

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainer_world

    @property
    def generator_index(self) -> int:
        return self.rank - self.trainer_world

    def generator_rank(self, index: int) -> int:
        return self.trainer_world + index

    @property
    def dp(self) -> int:
        return self.trainer_world

    @property
    def dp_rank(self) -> int:
        return self.rank if self.is_trainer else -1


def create_layout(config: RLConfig, rank: int, world_size: int) -> RLLayout:
    """The trainer ranks' runtime and the groups (collective: every rank calls it)."""
    t = config.trainer_world_size
    layout = RLLayout(rank=rank, world_size=world_size, trainer_world=t, n_generators=config.workers.generators)
    layout.runtime = ParallelRuntime.create(config.parallel, ranks=range(t), device=config.training.device)
    if world_size == 1:
        return layout
    if layout.runtime is not None:
        layout.trainer_group = layout.runtime.group
    head = [0, *range(t, world_size)]
    # gloo, CPU tensors: a CUDA model's weights are staged through host buffers (rl.transport), and a
    # generator may share its GPU with trainer rank 0 (GPU = LOCAL_RANK % GPUs), where NCCL would refuse
    layout.sync_group = dist.new_group(ranks=head, backend="gloo")
    layout.rollout_group = dist.new_group(ranks=head, backend="gloo")
    return layout
