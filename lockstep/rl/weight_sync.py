"""The RL job's resharding weight sync (``workers.weight_sync = "reshard"``), on top of :mod:`lockstep.rl.reshard`
(the plan) and :mod:`lockstep.rl.reshard_transfer` (the sends).

Each generator ``g`` has a sync group (the trainer ranks + its ranks, :mod:`lockstep.rl.layout`). Once,
at start, every rank of that group describes its model's layout and the descriptions are exchanged
over it (the trainer ranks do it in ``RLTrainer.__init__``, generator ``g``'s ranks at the start of
``run_generator``); every rank then computes the same :class:`~lockstep.rl.reshard.ReshardPlan`. Each
version, every trainer rank sends each generator rank its pieces (:class:`GroupSenders`); each
generator rank receives its own (:func:`generator_receiver`).

Within a generator group the head decides when a version is applied: each version it applies, it
tells the group's other ranks (a command over the engine group), which apply the same one, so every
rank of a group runs the engine on the same weights and frees its staging buffers as the head does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lockstep.rl.layout import RLLayout
from lockstep.rl.reshard import ReshardPlan, describe, exchange_layouts, side_layout
from lockstep.rl.reshard_transfer import ReshardReceiver, ReshardSender


def _plan(layout: RLLayout, index: int, mine: dict) -> ReshardPlan:
    """Generator ``index``'s plan (collective over its sync group: the trainer ranks and its ranks)."""
    trainer, generator = list(range(layout.trainer_world)), layout.generator_ranks(index)
    described = exchange_layouts(mine, group=layout.sync_groups[index])
    members = trainer + generator  # the group's ranks in order (all_gather_object's order)
    return ReshardPlan(side_layout(described, trainer, members), side_layout(described, generator, members))


class GroupSenders:
    """A trainer rank's sends to every generator group (collective at construction: the plans)."""

    def __init__(self, model: nn.Module, layout: RLLayout) -> None:
        self.layout = layout
        mine = describe(model, list(range(layout.trainer_world)), mesh=layout.runtime.mesh)
        self.plans = {g: _plan(layout, g, mine) for g in range(layout.n_generators)}  # same order everywhere
        self.senders = {g: ReshardSender(model, plan, layout.rank, layout.sync_groups[g],
                                         watch_rank=layout.generator_rank(g)) for g, plan in self.plans.items()}
        trainer = range(layout.trainer_world)
        #: payload bytes per version of all trainer ranks together, and of the busiest one
        self.bytes_total = sum(plan.bytes_sent(r) for plan in self.plans.values() for r in trainer)
        self.bytes_max_rank = max(sum(plan.bytes_sent(r) for plan in self.plans.values()) for r in trainer)

    def watch(self, watch: Any) -> None:
        """Watch every wait on a generator (trainer rank 0's liveness channel)."""
        for sender in self.senders.values():
            sender.watch = watch

    def send(self, version: int) -> dict[str, float]:
        out = {"weight_sync/wait_s": 0.0, "weight_sync/pack_s": 0.0, "weight_sync/s": 0.0, "weight_sync/bytes": 0.0}
        for sender in list(self.senders.values()):
            for key, value in sender.send(version).items():
                out[key] += value
        out.update({"weight_sync/bytes_all_ranks": float(self.bytes_total),
                    "weight_sync/bytes_max_rank": float(self.bytes_max_rank)})
        return out

    def drop(self, rank: int) -> None:
        """Send nothing more to the group whose head is ``rank`` (its pending sends are abandoned)."""
        self.senders.pop(self.layout.generator_of(rank), None)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()


def generator_receiver(model: nn.Module, layout: RLLayout, plan: ReshardPlan, *, first: int,
                       last: int) -> ReshardReceiver:
    """This generator rank's receiver of versions ``first .. last``."""
    return ReshardReceiver(model, plan, layout.rank, layout.sync_groups[layout.generator_index], first=first,
                           last=last)


def generator_plan(model: nn.Module, layout: RLLayout) -> ReshardPlan:
    """This generator's plan (collective over its sync group; the trainer ranks build theirs in GroupSenders)."""
    index = layout.generator_index
    return _plan(layout, index, describe(model, layout.generator_ranks(index)))
