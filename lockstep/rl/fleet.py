"""Trainer rank 0's side of its generator processes: who produces each step's batch
(:class:`~lockstep.rl.layout.StepPlan`), receiving rollouts and sending weights with every wait watched
by :mod:`lockstep.rl.liveness`, and what a lost generator does to the run (``liveness.on_generator_loss``):

- ``stop`` (default): :class:`~lockstep.rl.liveness.PeerLost` reaches the trainer's loop, which stops
  cleanly (an in-flight checkpoint save finishes; the newest checkpoint is the last one saved) and the
  command exits with status 3.
- ``continue``: the generator is dropped -- no more weights or rollouts go to or come from it, it is told
  so (should it come back, it exits), and its batches from the first step not yet received on go to the
  remaining generators (the same task seeds, generated with the weights they hold). The run stops as in
  ``stop`` when no generator is left, or when the launcher ends the job (torchrun does when a worker
  process dies).
"""

from __future__ import annotations

from typing import Any

from lockstep.rl.config import RLConfig
from lockstep.rl.layout import RLLayout, StepPlan
from lockstep.rl.liveness import PeerLost, TrainerLiveness
from lockstep.rl.transport import ROLLOUT_TAG, RolloutInbox, WeightSender


class Fleet:
    """The generators as trainer rank 0 sees them (``layout.liveness`` is its TrainerLiveness).

    ``model``: rank 0's unsharded copy, broadcast whole (``workers.weight_sync = "gather"``); or
    ``reshard``: this rank's :class:`~lockstep.rl.reshard.GroupSenders` (``"reshard"``), whose waits the
    liveness channel watches from here."""

    def __init__(self, config: RLConfig, layout: RLLayout, model: Any, reshard: Any = None) -> None:
        self.layout = layout
        self.live: TrainerLiveness = layout.liveness
        self.plan = StepPlan(layout.n_generators)
        if reshard is not None:
            reshard.watch(self.live)
            self.sender = reshard
        else:
            self.sender = WeightSender(model, layout.weight_groups, watch=self.live)
        self.inbox = RolloutInbox(layout.rollout_group, ROLLOUT_TAG, watch=self.live)
        #: one record per generator dropped (continue mode), for metrics.jsonl
        self.events: list[dict] = []
        self._next = 1  # the first step whose rollouts the trainer has not received

    def start(self, start: int, last: int) -> None:
        self._next = start + 1
        self.live.send_start({"start": start, "last": last})

    def receive(self, step: int) -> dict:
        """Step ``step``'s rollouts, from the generator that owns the step (now)."""
        self._next = step
        while True:
            src = self.layout.generator_rank(self.plan.owner(step))
            self.live.phase(f"waiting for the rollouts of step {step} from generator rank {src}")
            try:
                payload = self.inbox.receive(step, src)
            except PeerLost as lost:
                self._lost(lost)
                continue
            self._next = step + 1
            return payload

    def send_weights(self, version: int) -> dict[str, float]:
        self.live.phase(f"sending weights version {version}")
        while True:
            try:
                return self.sender.send(version)
            except PeerLost as lost:
                self._lost(lost)

    def check(self) -> None:
        """Handle every generator lost since the last look (drop it, or raise PeerLost to stop)."""
        while True:
            try:
                self.live.check()
                return
            except PeerLost as lost:
                self._lost(lost)

    def finish(self) -> None:
        """After the last step: wait for the last weights to go out, then tell the generators it is over."""
        self.live.phase("sending the last weights")
        while True:
            try:
                self.sender.close()
                break
            except PeerLost as lost:
                self._lost(lost)
        self.live.finish()

    def _lost(self, lost: PeerLost) -> None:
        index = self.layout.generator_of(lost.rank)
        left = [g for g in self.plan.alive if g != index]
        if not self.live.continue_on_loss or self.live.sigterm or not left or index not in self.plan.alive:
            raise lost
        self.plan.drop(index, self._next)
        self.sender.drop(lost.rank)
        self.inbox.drop(lost.rank)
        self.live.drop(lost.rank, from_step=self._next)
        self.events.append({
            "step": self._next - 1, "event": "generator_lost", "generator_lost/rank": lost.rank,
            "generator_lost/kind": lost.loss.kind, "generator_lost/phase": lost.loss.phase,
            "generator_lost/action": "continue", "generator_lost/reassigned_from_step": self._next,
            "generators_left": [self.layout.generator_rank(g) for g in left], "message": str(lost)})
