"""Who is who in an RL job, and the process groups between them.

Ranks ``0 .. T-1`` are the trainer (``T = parallel.dp_replicate x parallel.dp_shard x parallel.tp x
parallel.pp``): a :class:`~lockstep.parallel.runtime.ParallelRuntime` over those ranks only (its own
DeviceMesh and group; FSDP2/HSDP, TP, EP and pipeline stages over them by the same plan pretraining
uses). Then come the ``N`` generators, each a group of ``G = workers.generator_parallel`` tp x ep
processes: generator ``g`` is ranks ``T + g G .. T + (g + 1) G - 1``, its first rank the group's *head*
(the only one that talks to the trainer about rollouts and liveness; all ranks of the group run the
engine). Groups (every rank
creates every group, in the same order, as ``new_group`` requires):

- the runtime's group (``trainer_group``): the trainer ranks (a step's episodes are broadcast to
  them, metrics reduced);
- ``weight_groups`` (``workers.weight_sync = "gather"``): one per generator, trainer rank 0 + that
  generator (weight broadcasts: a generator that stops answering holds up no other one's weights);
- ``sync_groups`` (``"reshard"``): one per generator, the trainer ranks + that generator's ranks
  (point-to-point slices, :mod:`lockstep.rl.reshard`);
- ``engine_groups`` (G > 1): one per generator, its ranks (the engine's collectives, the head's
  commands to the others); with tp and ep both > 1 also its ``("ep", "tp")`` grid (``engine_grids``);
- ``rollout_group``: trainer rank 0 + the generators' heads (rollouts, point to point).

Trainer rank 0 and the heads also share a heartbeat channel (``liveness``,
:mod:`lockstep.rl.liveness`). :class:`StepPlan` says which generator produces each step's batch.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from lockstep.parallel.launch import resolve_device
from lockstep.parallel.runtime import ParallelRuntime
from lockstep.rl.config import RLConfig


@dataclasses.dataclass
class RLLayout:
    rank: int
    world_size: int
    trainer_world: int
    n_generators: int
    #: processes of one generator group (workers.generator_parallel tp x ep)
    group_size: int = 1
    #: the trainer ranks' runtime (None on generator ranks)
    runtime: ParallelRuntime | None = None
    trainer_group: object | None = None
    #: generator (head) rank -> the two-rank group (trainer rank 0, that generator) its weights go over
    weight_groups: dict[int, object] = dataclasses.field(default_factory=dict)
    #: generator index -> the group of the trainer ranks and that generator's ranks (resharding sync)
    sync_groups: dict[int, object] = dataclasses.field(default_factory=dict)
    #: generator index -> the group of its own ranks (group size > 1)
    engine_groups: dict[int, object] = dataclasses.field(default_factory=dict)
    #: generator index -> its ("ep", "tp") DeviceMesh (tp and ep both > 1; lockstep.generate.parallel)
    engine_grids: dict[int, object] = dataclasses.field(default_factory=dict)
    rollout_group: object | None = None
    #: trainer rank 0 and generators: the heartbeat channel (a TrainerLiveness / GeneratorLiveness)
    liveness: object | None = None

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainer_world

    @property
    def generator_index(self) -> int:
        """Which generator (group) this process belongs to."""
        return (self.rank - self.trainer_world) // self.group_size

    @property
    def is_head(self) -> bool:
        """A generator group's first rank (talks to the trainer)."""
        return not self.is_trainer and (self.rank - self.trainer_world) % self.group_size == 0

    def generator_rank(self, index: int) -> int:
        """Generator ``index``'s head rank."""
        return self.trainer_world + index * self.group_size

    def generator_ranks(self, index: int) -> list[int]:
        """Every rank of generator ``index``'s group."""
        head = self.generator_rank(index)
        return list(range(head, head + self.group_size))

    def generator_of(self, rank: int) -> int:
        """The generator index of a generator's (head) rank."""
        return (rank - self.trainer_world) // self.group_size

    @property
    def dp(self) -> int:
        return self.trainer_world

    @property
    def dp_rank(self) -> int:
        return self.rank if self.is_trainer else -1


def create_layout(config: RLConfig, rank: int, world_size: int) -> RLLayout:
    """The trainer ranks' runtime and the groups (collective: every rank calls it)."""
    t, n = config.trainer_world_size, config.workers.generators
    layout = RLLayout(rank=rank, world_size=world_size, trainer_world=t, n_generators=n,
                      group_size=config.workers.generator_parallel.size)
    layout.runtime = ParallelRuntime.create(config.parallel, ranks=range(t), device=config.training.device)
    if world_size == 1:
        return layout
    if layout.runtime is not None:
        layout.trainer_group = layout.runtime.group
    heads = [layout.generator_rank(g) for g in range(n)]
    head = [0, *heads]
    # gloo, CPU tensors: a CUDA model's weights are staged through host buffers (rl.transport), and a
    # generator may share its GPU with trainer rank 0 (GPU = LOCAL_RANK % GPUs), where NCCL would refuse
    if config.workers.resolved_weight_sync(t) == "gather":
        layout.weight_groups = {g: dist.new_group(ranks=[0, g], backend="gloo") for g in heads}
    else:
        layout.sync_groups = {g: dist.new_group(ranks=[*range(t), *layout.generator_ranks(g)], backend="gloo")
                              for g in range(n)}
    if layout.group_size > 1:
        layout.engine_groups = {g: dist.new_group(ranks=layout.generator_ranks(g), backend="gloo") for g in range(n)}
        par = config.workers.generator_parallel
        if par.tp > 1 and par.ep > 1:  # its row / column groups: made by every process too
            from lockstep.generate.parallel import generation_grid

            device = resolve_device(config.training.device).type
            layout.engine_grids = {g: generation_grid(layout.generator_ranks(g), par.ep, par.tp, device)
                                   for g in range(n)}
    layout.rollout_group = dist.new_group(ranks=head, backend="gloo")
    if rank in head and world_size > t:
        from lockstep.rl.liveness import connect_liveness

        live = config.liveness
        layout.liveness = connect_liveness(live.timeout_s, live.on_generator_loss, rank, head, layout.rollout_group)
    return layout


class StepPlan:
    """Which generator (by index) produces the batch of each step.

    Step ``i``'s is generator ``(i - 1) % N``'s. When generator ``g`` is lost (``drop(g, s)``, ``s`` the
    first step the trainer has not received), its steps from ``s`` on go to the remaining generators:
    step ``i`` to the ``(i - 1) % len(remaining)``-th of them, in index order. Trainer and generators
    apply the same drops in the same order, so they agree on every owner."""

    def __init__(self, n_generators: int, lost: list[tuple[int, int]] | None = None) -> None:
        self.n = n_generators
        #: (generator index, first reassigned step) in the order they were lost
        self.lost: list[tuple[int, int]] = list(lost or [])

    @property
    def alive(self) -> list[int]:
        gone = {g for g, _ in self.lost}
        return [g for g in range(self.n) if g not in gone]

    def drop(self, generator: int, from_step: int) -> None:
        self.lost.append((generator, from_step))

    def owner(self, step: int) -> int:
        owner, remaining = (step - 1) % self.n, list(range(self.n))
        for lost, from_step in self.lost:
            remaining.remove(lost)
            if owner == lost and step >= from_step and remaining:
                owner = remaining[(step - 1) % len(remaining)]
        return owner

    def steps_of(self, generator: int, start: int, last: int) -> list[int]:
        """The steps in ``start + 1 .. last`` whose batch ``generator`` produces."""
        return [i for i in range(start + 1, last + 1) if self.owner(i) == generator]
