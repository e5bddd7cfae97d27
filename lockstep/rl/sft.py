"""Supervised warm-up on an environment's task format, and held-out evaluation of a policy.

``sft_warmup`` teaches a model the answer format before RL: each example is the task's prompt
(rendered exactly as rollouts render it) followed by ``sft.response_template`` filled with the
task's reference answer and an end-of-sequence token; cross-entropy on the response tokens only.

``evaluate`` samples one greedy episode per held-out task seed with the generation engine and
reports the pass rate (reward >= ``task.pass_threshold``) and mean reward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import apply_routing_updates
from lockstep.parallel.grad import clip_grad_norm
from lockstep.parallel.runtime import ParallelRuntime
from lockstep.rl.config import RLConfig
from lockstep.rl.rollout import Rollout, encode_text, prompt_ids


def sft_example(task: Any, template: str, tokenizer: Any, chat_template: Any, add_bos: bool,
                eos_id: int | None) -> tuple[list[int], int]:
    """(prompt + target token ids, prompt length) of one task."""
    if getattr(task, "images", None):
        raise ConfigError(f"sft.steps: the SFT warm-up trains on text prompts only, and task {task.task_id!r} has "
                          "images; set sft.steps=0 for an image environment")
    prompt = prompt_ids(task, tokenizer, chat_template, add_bos)
    target = encode_text(tokenizer, template.format(answer=task.answer))
    if eos_id is not None:
        target.append(eos_id)
    return prompt + target, len(prompt)


def sft_warmup(model: nn.Module, env: Any, config: RLConfig, *, tokenizer: Any, chat_template: Any = None,
               eos_id: int | None = None, log: Callable[[dict], None] | None = None,
               runtime: ParallelRuntime | None = None) -> list[float]:
    """Run ``config.sft.steps`` AdamW steps on reference answers; returns the losses. Every trainer
    rank of a sharded model runs the same batches (the warm-up is small). ``runtime``: the one that
    parallelized ``model`` (tensor parallel: vocabulary-parallel cross-entropy on a width a multiple of
    tp; expert parallel: expert gradients scaled and norms summed over ep, as pretraining's step; a pipeline:
    the schedule's step with its cross-entropy, the runtime's clipping and optimizer step)."""
    sft = config.sft
    optimizer = dataclasses.replace(config.optimizer, lr=sft.lr).build(model)
    warmup = max(1, sft.steps // 10)
    model.train()
    tp = runtime.dims.tp if runtime is not None else 1
    losses = []
    for s in range(sft.steps):
        for group in optimizer.param_groups:
            group["lr"] = sft.lr * min(1.0, (s + 1) / warmup)
        examples = [sft_example(env.reset(seed), sft.response_template, tokenizer, chat_template,
                                config.rollout.add_bos, eos_id) for seed in config.task.sft_seeds(s, sft.batch_size)]
        width = -(-max(len(ids) for ids, _ in examples) // tp) * tp  # sequence parallel splits it evenly
        tokens = torch.zeros(len(examples), width, dtype=torch.long)
        targets = torch.full((len(examples), width), -100, dtype=torch.long)
        for i, (ids, p) in enumerate(examples):
            tokens[i, : len(ids)] = torch.tensor(ids)
            targets[i, p - 1: len(ids) - 1] = torch.tensor(ids[p:])
        max_norm = config.training.max_grad_norm or float("inf")
        if runtime is not None and runtime.pipeline is not None:  # the schedule's cross-entropy (the same mean)
            loss = runtime.pipeline.broadcast_loss(runtime.loss_and_backward((tokens, targets)).loss)
            runtime.clip_gradients(max_norm)  # the shared embedding's copies summed, the norm over the stages
            runtime.apply_step(optimizer)
            losses.append(loss)
            if log is not None:
                log({"sft_step": s + 1, "sft_loss": loss})
            continue
        with runtime.loss_context() if runtime is not None else contextlib.nullcontext():
            logits = model(tokens)
            if hasattr(model, "pop_auxiliary"):
                model.pop_auxiliary()
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
            loss.backward()
        if runtime is not None:
            runtime.after_backward(model)  # every ep rank ran the same batch: expert gradients summed ep times
            runtime.clip_grad_norm(model, max_norm)
        else:
            clip_grad_norm(model.parameters(), max_norm)
        optimizer.step()
        apply_routing_updates(model)  # MoE routing-bias step
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
        if log is not None:
            log({"sft_step": s + 1, "sft_loss": losses[-1]})
    return losses


def evaluate(engine: Any, env: Any, config: RLConfig, seeds: Sequence[int], *, tokenizer: Any,
             chat_template: Any = None) -> dict[str, float]:
    """Greedy pass rate and mean reward over ``seeds`` (one episode each)."""
    sampling = dataclasses.replace(config.rollout.sampling, temperature=0.0)
    rollout_config = dataclasses.replace(config.rollout, group_size=1, sampling=sampling)
    episodes = Rollout(engine, rollout_config, tokenizer=tokenizer, chat_template=chat_template).run(env, list(seeds))
    rewards = torch.tensor([float(ep.reward) for ep in episodes])
    lengths = torch.tensor([float(sum(ep.loss_mask)) for ep in episodes])
    return {"eval/pass_rate": float((rewards >= config.task.pass_threshold).float().mean()),
            "eval/reward_mean": float(rewards.mean()), "eval/response_length": float(lengths.mean()),
            "eval/tasks": len(episodes)}
