"""The RL trainer on its own layouts (``parallel.tp``, ``parallel.ep``): the SFT warm-up and the learner's steps
on fixed episodes equal one process's within fp32 rounding, and each weights version reaches one-process, TP-2 and EP-2
generators bit-exactly through the resharding sync. One spawn of 4 processes computes every case once."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from tests.rl.test_reshard import _mismatches
from tests.rl.test_rl_loop import debug_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]

#: loss and optimizer of every case: plain policy gradient (ratio 1: every token has a gradient), a KL term
#: (the frozen reference placed like the policy), a learning rate that moves the weights; two SFT warm-up
#: steps first (every rank the same batch)
FLAGS = ["--training.ratio-to", "current", "--loss.kl-coef", "0.05", "--optimizer.lr", "1e-3", "--sft.steps", "2",
         "--sft.batch-size", "4"]
STEPS = 2
#: the step metrics compared with one process
KEYS = ("loss", "grad_norm", "loss/pg_loss", "loss/kl")
#: name -> (family, parallel config fields, trainer ranks, generators: (kind, ranks) each)
CASES = {
    "tp2": ("llama3", {"tp": 2, "dp_shard": 1}, [0, 1], [("whole", [2]), ("tp", [2, 3])]),
    "dp2xtp2": ("llama3", {"tp": 2, "dp_shard": 2}, [0, 1, 2, 3], []),
    "ep2": ("qwen3_moe", {"ep": 2, "dp_shard": 2}, [0, 1], [("ep", [2, 3])]),
}


def _config(root, family):
    from lockstep.models.registry import model_config

    config = debug_config(root, *FLAGS)
    return dataclasses.replace(config, model=model_config(family, "debug"))


def _records(config, step):
    """Two groups of four episodes of uneven lengths (a padded batch), fixed by ``step``."""
    from lockstep.rl.learner import EpisodeRecord

    gen = torch.Generator().manual_seed(step)
    vocab = min(config.model.vocab_size, 200)
    out = []
    for group in range(2):
        for sample in range(config.rollout.group_size):
            prompt, response = 3 + (sample % 3), 2 + (group + sample) % 5
            ids = torch.randint(5, vocab, (prompt + response,), generator=gen).tolist()
            out.append(EpisodeRecord(group=group, sample=sample, task_seed=group, task_id=f"t{group}",
                                     prompt_len=prompt, token_ids=ids, loss_mask=[0] * prompt + [1] * response,
                                     logprobs=[0.0] * (prompt + response), reward=float(sample % 2 + group),
                                     policy_version=step - 1, temperature=1.0, num_turns=1, truncated=None))
    return out


def _steps(learner, config) -> list[dict]:
    return [_step(learner, config, s) for s in range(1, STEPS + 1)]


def _step(learner, config, step) -> dict:
    out = learner.step(step, _records(config, step), trainer_version=step - 1)
    return {k: out[k] for k in KEYS}


def _sft(model, config, policy, runtime=None) -> list[float]:
    from lockstep.rl.sft import sft_warmup

    return sft_warmup(model, config.task.build(), config, tokenizer=policy.tokenizer, eos_id=policy.eos_id,
                      runtime=runtime)


@functools.lru_cache(maxsize=None)
def _one_process(root, family):
    """The reference: one process, the same episodes (once per family and test run)."""
    from lockstep.rl.learner import Learner
    from lockstep.rl.policy import load_policy

    config = _config(root, family)
    policy = load_policy(config)
    model = policy.model
    learner = Learner(config, model)  # the KL reference: a copy from before the warm-up, as the trainer's
    sft = _sft(model, config, policy)
    steps = _steps(learner, config)
    return sft, steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _generator_model(config, kind, group):
    from lockstep.generate.parallel import shard_for_generation
    from lockstep.rl.policy import load_policy

    model = load_policy(dataclasses.replace(config, seed=config.seed + 1)).model  # other weights until synced
    if kind != "whole":
        shard_for_generation(model, **{kind: 2}, group=group)
    return model


def _case(rank, world, root, name, groups, sync_groups, cases=None):
    import torch.distributed as dist

    from lockstep.parallel.dims import ParallelConfig
    from lockstep.parallel.runtime import ParallelRuntime
    from lockstep.rl.learner import Learner
    from lockstep.rl.policy import load_policy
    from lockstep.rl.reshard import ReshardPlan, describe, exchange_layouts, side_layout
    from lockstep.rl.reshard_transfer import ReshardReceiver, ReshardSender

    family, fields, trainer, generators = (cases or CASES)[name]
    config = _config(root, family)
    runtime = ParallelRuntime.create(ParallelConfig(**fields), ranks=trainer, device="cpu")
    out: dict = {}
    learner = model = None
    if runtime is not None:
        policy = load_policy(config)
        reference = runtime.shard_frozen(copy.deepcopy(policy.model), ParallelConfig(**fields))
        model = runtime.parallelize(policy.model, ParallelConfig(**fields))
        learner = Learner(config, model, runtime, reference=reference)
        out["sft"] = _sft(model, config, policy, runtime)
    syncs = []  # (kind, generator ranks, this rank's generator model, its sender / receiver)
    for (kind, ranks), group in zip(generators, sync_groups):  # a group each: rank 2 receives from two plans
        mine, gen_model = None, None
        if runtime is not None:
            mine = describe(model, trainer, mesh=runtime.mesh)
        elif rank in ranks:
            gen_model = _generator_model(config, kind, groups.get(tuple(ranks)))
            mine = describe(gen_model, ranks)
        described = exchange_layouts(mine)
        plan = ReshardPlan(side_layout(described, trainer, list(range(world))),
                           side_layout(described, ranks, list(range(world))))
        end = None
        if runtime is not None:
            end = ReshardSender(model, plan, rank, group)
        elif rank in ranks:
            end = ReshardReceiver(gen_model, plan, rank, group, first=1, last=STEPS)
        syncs.append((kind, ranks, gen_model, end))
    losses = []
    for step in range(1, STEPS + 1):
        if learner is not None:
            losses.append(_step(learner, config, step))
            for _, _, _, sender in syncs:
                sender.send(step)
                sender.wait()
        full = runtime.full_state_dict(model) if runtime is not None else None
        box = [full]
        dist.broadcast_object_list(box, src=0)  # the trainer's weights of this version, on every rank
        full = box[0]
        for kind, ranks, gen_model, receiver in syncs:
            if rank in ranks:
                receiver.apply_until(step)
                out[f"{kind}{ranks}:v{step}"] = _mismatches(gen_model, full)
        if runtime is not None and runtime.dims.tp > 1 and runtime.dims.dp > 1:  # FSDP over TP: strided boxes
            layouts = describe(model, trainer, mesh=runtime.mesh)
            out[f"boxes:v{step}"] = _mismatches(model, full, {n: t.box(rank) for n, t in layouts.items()})
    for _, _, _, end in syncs:
        if isinstance(end, ReshardSender):
            end.close()
    if rank == 0:
        out["losses"], out["final"] = losses, full
    return out


def _worker(rank, world, init_file, out_dir):
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    groups = {(2, 3): dist.new_group([2, 3])}
    sync_groups = [dist.new_group(list(range(world))) for _ in range(2)]
    results = {}
    for name in CASES:
        results[name] = _case(rank, world, Path(out_dir), name, groups, sync_groups)
        dist.barrier()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture
def parallel_trainer(computed_once):
    import torch.multiprocessing as mp

    def run(d):
        mp.spawn(_worker, args=(4, str(d / "init"), str(d)), nprocs=4, join=True)

    out = computed_once("rl trainer tp/ep spawn world 4", run)
    return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(4)}


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_trainer_steps_match_one_process_and_sync_bitwise(parallel_trainer, tmp_path_factory, name):
    """SFT losses, RL losses, grad norms and final weights of the TP / EP trainer vs one process on the same
    episodes.
    Tolerance: TP sums each row-parallel product over two halves and EP adds the experts' gradients in
    another order (fp32 rounding, ~1e-7 relative per op); 1e-4 is far below what a wrong shard, a missing
    gradient sum or a loss counted twice over tp would give (O(1) relative). Every generator rank holds,
    after each version, exactly the trainer's weights (``torch.equal`` per local shard)."""
    family, fields, _, generators = CASES[name]
    want_sft, want_steps, want_final = _one_process(tmp_path_factory.getbasetemp() / "one-process", family)
    res = parallel_trainer
    got = res[0][name]
    assert len(want_sft) == 2 and got["sft"] == pytest.approx(want_sft, rel=1e-4), (name, want_sft, got["sft"])
    # the KL metric is each data-parallel share's token mean weighted by its sequences: equal to one process's
    # only without data parallelism (the loss and the gradient are the step's own, on every layout)
    keys = ["loss", "grad_norm", "loss/pg_loss"] + (["loss/kl"] if fields.get("dp_shard", 1) == 1 else [])
    for a, b in zip(want_steps, got["losses"]):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, key, a, b)
    assert got["losses"][1]["grad_norm"] > 0 and got["losses"][1]["loss/kl"] > 0  # the weights moved
    final = got["final"]
    assert max(float((final[k] - want_final[k]).abs().max()) for k in want_final) < 1e-4
    for kind, ranks in generators:
        for rank in ranks:
            for step in range(1, STEPS + 1):
                assert res[rank][name][f"{kind}{ranks}:v{step}"] == [], (name, kind, rank, step)
    if name == "dp2xtp2":
        for rank in range(4):
            assert all(res[rank][name][f"boxes:v{s}"] == [] for s in range(1, STEPS + 1)), rank
