"""Who is who in an RL job, and the process groups between them.

Ranks ``0 .. T-1`` are the trainer (``T = parallel.dp_replicate x parallel.dp_shard``; their own
DeviceMesh, FSDP2/HSDP over it), ranks ``T .. T+N-1`` the generators. Groups (every rank creates
every group, in the same order, as ``new_group`` requires):

- ``trainer_group``: the trainer ranks (a step's episodes are broadcast to them, metrics reduced);
- ``sync_group``: trainer rank 0 + the generators (weight broadcasts);
- ``rollout_group``: trainer rank 0 + the generators (rollouts, point to point).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from lockstep.parallel.dims import ParallelDims
from lockstep.rl.config import RLConfig


@dataclasses.dataclass
class RLLayout:
    rank: int
    world_size: int
    trainer_world: int
    n_generators: int
    dims: ParallelDims | None = None
    mesh: object | None = None
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
    """The groups and the trainer's mesh (collective: every rank calls it)."""
    t = config.trainer_world_size
    layout = RLLayout(rank=rank, world_size=world_size, trainer_world=t, n_generators=config.workers.generators)
    if world_size == 1:
        return layout
    layout.dims = config.parallel.resolve(t)
    names = [n for n, _ in layout.dims.mesh_dims]
    if names:  # a DeviceMesh over the trainer ranks only; generator ranks take part in creating it
        from torch.distributed.device_mesh import DeviceMesh

        shape = tuple(d for _, d in layout.dims.mesh_dims)
        layout.mesh = DeviceMesh("cpu", torch.arange(t).view(shape), mesh_dim_names=tuple(names))
    layout.trainer_group = dist.new_group(ranks=list(range(t)), backend="gloo")
    head = [0, *range(t, world_size)]
    layout.sync_group = dist.new_group(ranks=head, backend="gloo")  # CPU tensors: the model lives on the CPU
    layout.rollout_group = dist.new_group(ranks=head, backend="gloo")
    return layout


def shard_trainer(model: nn.Module, layout: RLLayout, config: RLConfig) -> nn.Module:
    """FSDP2 (or HSDP) over the trainer ranks: each block a unit, then the root."""
    if layout.dp == 1:
        return model
    import warnings

    from lockstep.parallel.fsdp import apply_fsdp, dp_mesh

    # the batch-invariant head returns a view of its padded tile; nothing writes to it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    apply_fsdp(model, list(model.layers.values()), dp_mesh(layout.mesh, layout.dims), config.parallel.fsdp_param_dtype,
               config.parallel.reshard_after_forward)
    return model


def full_state(model: nn.Module, layout: RLLayout) -> dict[str, torch.Tensor]:
    """The unsharded state on trainer rank 0 (collective over the trainer ranks; empty elsewhere)."""
    if layout.dp == 1:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
