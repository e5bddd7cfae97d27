"""A generator process of an RL job: receive weights, roll out batches, send them to the trainer.

Generator ``g`` of ``N`` produces the batches of steps ``i`` with ``(i - 1) % N == g`` (and, when
another generator is lost and the run goes on without it, its share of that one's batches:
:class:`~lockstep.rl.layout.StepPlan`). Before batch ``i`` it applies every weight version that has
arrived and, if it still holds a version older than ``i - 1 - max_offpolicy_steps``, waits for that
one: so a batch is never staler than the trainer allows when it is trained on, and with
``max_offpolicy_steps=0`` generation and training alternate strictly (on-policy). Each episode
carries the version that generated it.

A generator runs on ``training.device`` as the trainer does (this process's GPU on CUDA): its
engine and KV cache follow the model there, and weight versions arrive in buffers on the device its
weight group carries (:mod:`lockstep.rl.transport`). It tells the trainer what it is doing (its
phase) over the heartbeat channel (:mod:`lockstep.rl.liveness`), which also ends it when the trainer
is lost, stops the run, or drops it.

**Generator groups** (``workers.generator_parallel`` tp or ep > 1): a generator is a group of processes
running :class:`~lockstep.generate.parallel.GroupEngine` on a model sharded by
:func:`~lockstep.generate.parallel.shard_for_generation`. The group's head runs the loop above; it
tells the other ranks (over the group) each weights version it applies and each batch it generates,
and they do the same (the engine's collectives need every rank; results are the head's). Each rank
receives its own slices of every version from the trainer ranks (:mod:`lockstep.rl.weight_sync`).
In batch-invariant mode a generator of a smaller TP degree than the trainer's sums its row-parallel
layers as the trainer does (:mod:`lockstep.rl.tp_split`).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lockstep import numerics

from lockstep.generate.engine import Engine
from lockstep.parallel.launch import resolve_device
from lockstep.rl.config import RLConfig
from lockstep.rl.layout import RLLayout, StepPlan
from lockstep.rl.learner import EpisodeRecord
from lockstep.rl.policy import Policy
from lockstep.rl.rollout import Rollout
from lockstep.rl.tp_split import plan_tp_split
from lockstep.rl.transport import ROLLOUT_TAG, ObjectSender, WeightReceiver

__all__ = ["ROLLOUT_TAG", "rollout_batch_payload", "run_generator"]


def rollout_batch_payload(rollout: Rollout, env, config: RLConfig, step: int, version: int) -> dict:
    """Roll out step ``step``'s tasks with the weights of ``version``; what is sent to the trainer."""
    started = time.perf_counter()
    episodes = rollout.run(env, config.task.train_seeds(step), policy_version=version)
    seconds = time.perf_counter() - started
    records = [EpisodeRecord.from_episode(ep) for ep in episodes]
    tokens = sum(r.generated_tokens for r in records)
    return {"step": step, "version": version, "records": records, "generate_s": seconds,
            "generated_tokens": tokens, "generator/tokens_per_s": tokens / seconds if seconds else 0.0}


def run_generator(config: RLConfig, policy: Policy, layout: RLLayout) -> None:
    """The generator loop (every generator rank); returns when its last batch is delivered, the last weight
    version received and the trainer has finished. A group's head runs the loop below; its other ranks
    follow its commands (:func:`_follow_head`)."""
    group = layout.engine_groups.get(layout.generator_index)
    policy.model.to(resolve_device(config.training.device))
    if group is not None:  # before describing the layout: the slices this rank holds are the sharded ones
        from lockstep.generate.parallel import shard_for_generation

        par = config.workers.generator_parallel
        shard_for_generation(policy.model, tp=par.tp, ep=par.ep, group=group, field="workers.generator_parallel",
                             grid=layout.engine_grids.get(layout.generator_index))
    plan_tp_split(config, policy.model).apply(policy.model, "generator")  # the trainer's TP degree's sums
    plan = None
    if config.workers.resolved_weight_sync(layout.trainer_world) == "reshard":
        from lockstep.rl.weight_sync import generator_plan

        plan = generator_plan(policy.model, layout)  # collective with the trainer ranks
    commands = _Commands(group, layout.generator_rank(layout.generator_index))
    if not layout.is_head:
        _follow_head(config, policy, layout, plan, commands)
        return
    live = layout.liveness
    live.phase("waiting for the trainer to start")
    info = live.wait_start()
    commands.tell(("start", info))
    if "error" in info:
        return
    start, last = info["start"], info["last"]
    if last <= start:
        live.finish()
        return
    live.phase("starting the engine")
    receiver = _receiver(policy, layout, plan, start, last - 1)
    if group is not None:
        receiver.on_apply = lambda version: commands.tell(("apply", version))
    engine = _build_engine(config, policy)
    synced = receiver.version  # the weights version the engine runs (lockstep's engine reads the model itself)
    rollout = Rollout(engine, config.rollout, tokenizer=policy.tokenizer, chat_template=policy.chat_template)
    env = config.task.build()
    sender = ObjectSender(dst=0, group=layout.rollout_group, tag=ROLLOUT_TAG)
    produced: set[int] = set()
    while True:
        seen = live.changes
        plan_steps = StepPlan(layout.n_generators,
                              [(layout.generator_of(rank), s) for rank, s in live.lost_generators])
        step = next((i for i in range(start + 1, last + 1)
                     if i not in produced and plan_steps.owner(i) == layout.generator_index), None)
        if step is None and receiver.version >= receiver.last:
            # its batches are out and every version is in: it stays until the trainer finishes, since a
            # lost generator's last batches may still come its way
            _wait_sent(sender, receiver, live, "sending the last rollouts")
            live.phase("waiting for the trainer to finish")
            if live.wait_end(seen):
                break
            continue
        # no batch of its own left: receive the remaining versions (the trainer's broadcasts need every
        # generator), unless a lost generator's batches come its way meanwhile
        needed = receiver.last if step is None else max(start, step - 1 - config.workers.max_offpolicy_steps)
        live.phase(f"receiving weights version {needed}" + ("" if step is None else f" for batch {step}"))
        # with one generator no batch can come its way: wait blocking, as without liveness
        interrupt = (lambda: live.changes != seen) if layout.n_generators > 1 else None
        waited = receiver.wait_for(needed, interrupt=interrupt)
        if waited is None or step is None:
            continue  # a generator was lost (this one may own an earlier batch now), or every version is in
        sync = {}
        if config.workers.engine == "vllm" and receiver.version != synced:
            live.phase(f"loading weights version {receiver.version} into vLLM")
            done = engine.load_weights()
            synced = receiver.version
            sync = {"generator/weight_sync_s": done["seconds"], "generator/weight_sync_bytes": done["bytes"]}
        elif plan is not None:
            sync = {"generator/weight_sync_bytes": float(receiver.bytes),
                    "generator/weight_sync_group_bytes": float(sum(p.nbytes for p in plan.pieces))}
        live.phase(f"generating batch {step} with weights version {receiver.version}")
        commands.tell(("generate", step))
        payload = rollout_batch_payload(rollout, env, config, step, receiver.version)
        payload.update({**sync, "numerics": numerics.thread_settings(), "generator/weight_wait_s": waited,
                        "generator/rank": layout.rank,
                        "generator/weight_apply_s": receiver.apply_s})
        _wait_sent(sender, receiver, live, f"sending the rollouts of step {max(produced, default=step)}")
        sender.send(payload)
        produced.add(step)
    commands.tell(("done",))
    sender.close()
    live.finish()
    if hasattr(engine, "close"):  # the vLLM engine: its engine-core processes
        engine.close()


def _receiver(policy: Policy, layout: RLLayout, plan, first: int, last: int):
    """This rank's weight receiver: its slices (resharding sync) or the whole flat state (gather)."""
    if plan is not None:
        from lockstep.rl.weight_sync import generator_receiver

        return generator_receiver(policy.model, layout, plan, first=first, last=last)
    return WeightReceiver(policy.model, layout.weight_groups[layout.rank], first=first, last=last)


class _Commands:
    """The head's commands to the other ranks of its group (one broadcast each over the engine group;
    nothing without a group)."""

    def __init__(self, group, head: int) -> None:
        self.group, self.head = group, head

    def tell(self, command: tuple) -> None:
        if self.group is not None:
            dist.broadcast_object_list([command], src=self.head, group=self.group)

    def hear(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=self.head, group=self.group)
        return box[0]


def _follow_head(config: RLConfig, policy: Policy, layout: RLLayout, plan, commands: _Commands) -> None:
    """A group's non-head rank: apply the versions the head applies, generate the batches it generates
    (the engine's collectives need every rank; the head's sampled tokens are everyone's)."""
    _, info = commands.hear()
    if "error" in info or info["last"] <= info["start"]:
        return
    receiver = _receiver(policy, layout, plan, info["start"], info["last"] - 1)
    engine = _build_engine(config, policy)
    rollout = Rollout(engine, config.rollout, tokenizer=policy.tokenizer, chat_template=policy.chat_template)
    env = config.task.build()
    while True:
        command = commands.hear()
        if command[0] == "apply":
            receiver.apply_until(command[1])
        elif command[0] == "generate":
            rollout_batch_payload(rollout, env, config, command[1], receiver.version)
        else:
            receiver.drain()
            return


def _build_engine(config: RLConfig, policy: Policy):
    """The generator's engine (``workers.engine``; a generator group's: lockstep's, on every rank)."""
    if config.workers.generator_parallel.size > 1:
        from lockstep.generate.parallel import GroupEngine

        return GroupEngine(policy.model, policy.tokenizer, config.engine)
    if config.workers.engine == "vllm":
        from lockstep.vllm.engine import VllmEngine

        return VllmEngine(policy.model, policy.tokenizer, config.engine)
    return Engine(policy.model, policy.tokenizer, config.engine)


def _wait_sent(sender: ObjectSender, receiver: WeightReceiver, live, phase: str) -> None:
    """Wait until the previous batch is delivered, applying weights that arrive meanwhile: the
    trainer may be waiting for this generator to free a staging buffer before it can go on."""
    if sender.busy():
        live.phase(phase)
    while sender.busy():
        receiver.poll()
        time.sleep(0.001)
    sender.wait()
