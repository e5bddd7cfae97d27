"""A generator process of an RL job: receive weights, roll out batches, send them to the trainer.

Generator ``g`` of ``N`` produces the batches of steps ``i`` with ``(i - 1) % N == g``. Before
batch ``i`` it applies every weight version that has arrived and, if it still holds a version older
than ``i - 1 - max_offpolicy_steps``, waits for that one: so a batch is never staler than the
trainer allows when it is trained on, and with ``max_offpolicy_steps=0`` generation and training
alternate strictly (on-policy). Each episode carries the version that generated it.

A generator runs on ``training.device`` as the trainer does (this process's GPU on CUDA): its
engine and KV cache follow the model there, and weight versions arrive in buffers on the device the
sync group carries (:mod:`lockstep.rl.transport`).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lockstep import numerics

from lockstep.generate.engine import Engine
from lockstep.parallel.launch import resolve_device
from lockstep.rl.config import RLConfig
from lockstep.rl.layout import RLLayout
from lockstep.rl.learner import EpisodeRecord
from lockstep.rl.policy import Policy
from lockstep.rl.rollout import Rollout
from lockstep.rl.transport import ObjectSender, WeightReceiver

ROLLOUT_TAG = 7


def steps_of(generator_index: int, n_generators: int, start: int, last: int) -> list[int]:
    """The steps (1-based) whose batch this generator produces."""
    return [i for i in range(start + 1, last + 1) if (i - 1) % n_generators == generator_index]


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
    """The generator loop (ranks T..T+N-1); returns when its last batch is delivered."""
    n = config.workers.generators
    sync_group, rollout_group = layout.sync_group, layout.rollout_group
    start_info: list = [None]
    dist.broadcast_object_list(start_info, src=0, group=sync_group)
    info = start_info[0]
    if "error" in info:
        return
    start, last = info["start"], info["last"]
    if last <= start:
        return
    policy.model.to(resolve_device(config.training.device))
    receiver = WeightReceiver(policy.model, sync_group, first=start, last=last - 1)
    engine = Engine(policy.model, policy.tokenizer, config.engine)
    rollout = Rollout(engine, config.rollout, tokenizer=policy.tokenizer, chat_template=policy.chat_template)
    env = config.task.build()
    sender = ObjectSender(dst=0, group=rollout_group, tag=ROLLOUT_TAG)
    for step in steps_of(layout.generator_index, n, start, last):
        needed = max(start, step - 1 - config.workers.max_offpolicy_steps)
        waited = receiver.wait_for(needed)
        payload = rollout_batch_payload(rollout, env, config, step, receiver.version)
        payload.update({"numerics": numerics.thread_settings(), "generator/weight_wait_s": waited,
                        "generator/rank": layout.rank,
                        "generator/weight_apply_s": receiver.apply_s})
        _wait_sent(sender, receiver)
        sender.send(payload)
    _wait_sent(sender, receiver)
    sender.close()
    receiver.drain()


def _wait_sent(sender: ObjectSender, receiver: WeightReceiver) -> None:
    """Wait until the previous batch is delivered, applying weights that arrive meanwhile: the
    trainer may be waiting for this generator to free a staging buffer before it can go on."""
    while sender.busy():
        receiver.poll()
        time.sleep(0.001)
    sender.wait()
