"""The RL trainer on its own layouts (``parallel.tp``, ``parallel.ep``, ``parallel.dp_replicate``, ``parallel.pp`` and
their products):
the SFT warm-up and the learner's steps on fixed episodes equal one process's within fp32 rounding, and each weights
version reaches one-process, TP-2, EP-2 and TP-2 x EP-2 generators bit-exactly through the resharding sync; the
TP x EP generator group then generates the tokens of one process. One spawn of 6 processes computes every case once
(ranks a case does not use wait)."""

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
    # FSDP (experts sharded like every other weight) -> an ep x tp generator group
    "dp2": ("qwen3_moe", {"dp_shard": 2}, [0, 1], [("tpxep", [2, 3, 4, 5])]),
    # experts on ep, each ep rank's split on its hidden dim over tp; attention / dense parts TP, FSDP over dp
    "tp2xep2": ("qwen3_moe", {"tp": 2, "ep": 2, "dp_shard": 2}, [0, 1, 2, 3], [("whole", [4]), ("ep", [4, 5])]),
    # HSDP + EP: the experts replicated over dp_replicate (FSDP's replicas), split over ep
    "hsdp2xep2": ("qwen3_moe", {"dp_replicate": 2, "ep": 2, "dp_shard": 2}, [0, 1, 2, 3], [("tp", [4, 5])]),
    # HSDP over TP
    "hsdp2xtp2": ("llama3", {"dp_replicate": 2, "tp": 2, "dp_shard": 1}, [0, 1, 2, 3], [("tp", [4, 5])]),
    # pipelines (the policy loss on the schedule's last stage, the KL reference forward-only through a pipeline
    # of its own; tests/rl/test_rl_trainer_pipeline.py has their refusals and the CLI run). qwen3_moe's debug
    # flavour ties its head to the embedding: the first and last stage share it (their gradients summed)
    "pp2": ("llama3", {"pp": 2, "dp_shard": 1}, [0, 1], [("whole", [2]), ("tp", [2, 3])]),
    "pp2_moe": ("qwen3_moe", {"pp": 2, "dp_shard": 1}, [0, 1], [("whole", [2])]),
    "pp2xdp2": ("llama3", {"pp": 2, "dp_shard": 2}, [0, 1, 2, 3], [("tp", [4, 5])]),
    "pp2xhsdp2": ("llama3", {"pp": 2, "dp_replicate": 2, "dp_shard": 1}, [0, 1, 2, 3], []),
    # each stage tensor-parallel: the last stage's vocabulary-sharded logits gathered before scoring
    "pp2xtp2": ("llama3", {"pp": 2, "tp": 2, "dp_shard": 1}, [0, 1, 2, 3], [("whole", [4])]),
    # each stage's experts split over ep (outside FSDP)
    "pp2xep2": ("qwen3_moe", {"pp": 2, "ep": 2, "dp_shard": 2}, [0, 1, 2, 3], [("ep", [4, 5])]),
}
#: each generator kind's ``shard_for_generation`` degrees
GENERATOR_DEGREES = {"tp": {"tp": 2}, "ep": {"ep": 2}, "tpxep": {"tp": 2, "ep": 2}}
#: the generator groups of the spawn (every rank makes every group, in this order)
GROUPS = [(2, 3), (4, 5), (2, 3, 4, 5)]
WORLD = 6


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


def _generator_model(config, kind, group, grid=None):
    from lockstep.generate.parallel import shard_for_generation
    from lockstep.rl.policy import load_policy

    model = load_policy(dataclasses.replace(config, seed=config.seed + 1)).model  # other weights until synced
    if kind != "whole":
        shard_for_generation(model, **GENERATOR_DEGREES[kind], group=group, grid=grid)
    return model


def _requests():
    """Four greedy requests of mixed prompt lengths (fixed ids)."""
    from lockstep.generate import Request, SamplingParams

    gen = torch.Generator().manual_seed(5)
    return [Request(prompt_ids=torch.randint(5, 200, (n,), generator=gen).tolist(), request_id=str(i),
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
            for i, n in enumerate((3, 9, 5, 12))]


def _greedy(model, engine_class) -> dict[str, list[int]]:
    from lockstep.generate import EngineConfig

    engine = engine_class(model, None, EngineConfig(cache_memory_mb=2, block_size=4, max_batch_size=2,
                                                    pack_weights=False))
    return {r.request_id: list(r.token_ids) for r in engine.generate(_requests())}


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
            gen_model = _generator_model(config, kind, groups.get(tuple(ranks)), groups.get(("grid", *ranks)))
            mine = describe(gen_model, ranks)
        described = exchange_layouts(mine)
        plan = ReshardPlan(side_layout(described, trainer, list(range(world))),
                           side_layout(described, ranks, list(range(world))))
        if rank == 0:  # the two sides' descriptions (as dicts: torch.load's allowed types), for the plan check
            for key, side in ((f"layout:{kind}", ranks), ("layout:trainer", trainer)):
                out[key] = {n: dataclasses.asdict(t) for n, t in side_layout(described, side, list(range(world))).items()}
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
        if runtime is not None and runtime.world_size > 1:  # each rank's shards are where describe() says
            layouts = describe(model, trainer, mesh=runtime.mesh)
            out[f"boxes:v{step}"] = _mismatches(model, full, {n: t.box(rank) for n, t in layouts.items()})
    for _, _, _, end in syncs:
        if isinstance(end, ReshardSender):
            end.close()
    if any(kind == "tpxep" for kind, _ in generators):  # the synced group generates one process's tokens
        from lockstep.generate import Engine
        from lockstep.generate.parallel import GroupEngine

        if rank == 0:
            whole = load_policy(config).model
            whole.load_state_dict(full)
            out["greedy:one-process"] = _greedy(whole, Engine)
        for kind, ranks, gen_model, _ in syncs:
            if kind == "tpxep" and rank in ranks:
                out["greedy:tpxep"] = _greedy(gen_model, GroupEngine)
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
    from lockstep.generate.parallel import generation_grid

    groups = {ranks: dist.new_group(list(ranks)) for ranks in GROUPS}
    groups[("grid", 2, 3, 4, 5)] = generation_grid([2, 3, 4, 5], ep=2, tp=2)  # the tp x ep group's rows / columns
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
        mp.spawn(_worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, join=True)

    out = computed_once(f"rl trainer tp/ep spawn world {WORLD}", run)
    return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)}


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_trainer_steps_match_one_process_and_sync_bitwise(parallel_trainer, tmp_path_factory, name):
    """SFT losses, RL losses, grad norms and final weights of the TP / EP / HSDP / pipelined trainer vs one process
    on the same episodes.
    Tolerance: TP sums each row-parallel product over two halves, EP adds the experts' gradients in another
    order, HSDP reduces over two dims, a pipeline sums its schedule's micro-batch losses and runs every position
    through the head (fp32 rounding, ~1e-7 relative per op); 1e-4 is far below what a wrong
    shard, a missing gradient sum or a loss counted twice over tp would give (O(1) relative). Every generator
    rank holds, after each version, exactly the trainer's weights (``torch.equal`` per local shard), and every
    trainer rank's shards are the regions its description gives the plan. A TP x EP generator group's greedy
    tokens (fp32) are one process's from the same weights."""
    family, fields, _, generators = CASES[name]
    want_sft, want_steps, want_final = _one_process(tmp_path_factory.getbasetemp() / "one-process", family)
    res = parallel_trainer
    got = res[0][name]
    assert len(want_sft) == 2 and got["sft"] == pytest.approx(want_sft, rel=1e-4), (name, want_sft, got["sft"])
    # the KL metric is each data-parallel share's token mean weighted by its sequences: equal to one process's
    # only without data parallelism (the loss and the gradient are the step's own, on every layout)
    keys = ["loss", "grad_norm", "loss/pg_loss"] + (["loss/kl"] if fields.get("dp_shard", 1) * fields.get("dp_replicate", 1) == 1 else [])
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
    for rank in CASES[name][2]:
        assert all(res[rank][name][f"boxes:v{s}"] == [] for s in range(1, STEPS + 1)), rank
    for kind, ranks in generators:
        if kind == "tpxep":
            want = got["greedy:one-process"]
            assert all(len(t) == 6 for t in want.values())
            assert all(res[rank][name]["greedy:tpxep"] == want for rank in ranks), name


def test_plan_from_tp_x_ep_trainer_to_tp_x_ep_generator_moves_every_element_once(parallel_trainer):
    """The plan between the two layouts no 6-process spawn can hold together (a TP 2 x EP 2 trainer and a TP 2 x
    EP 2 generator group: 8 ranks), from their real descriptions (the ``tp2xep2`` trainer's, the ``dp2`` case's
    generator group's, renumbered to ranks 4-7): applied to random tensors, each generator rank's local regions
    are filled exactly (torch.equal) from the trainer ranks' regions, and each element goes once per holder."""
    import dataclasses as dc

    from lockstep.rl.reshard import ReshardPlan, TensorLayout

    trainer = {n: TensorLayout(**t) for n, t in parallel_trainer[0]["tp2xep2"]["layout:trainer"].items()}
    generator = {name: dc.replace(TensorLayout(**t), mesh_ranks=tuple(r + 2 for r in t["mesh_ranks"]))
                 for name, t in parallel_trainer[0]["dp2"]["layout:tpxep"].items()}
    assert {t.placements for n, t in generator.items() if n.endswith("experts.w1")} == {(("S", 0), ("S", 1))}
    assert {t.placements for n, t in trainer.items() if n.endswith("experts.w2")} == {(("R",), ("S", 0), ("S", 2))}
    plan = ReshardPlan(trainer, generator)
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(t.shape, generator=gen) for name, t in trainer.items()}

    def region(tensor, box):
        return tensor[tuple(slice(a, b) for a, b in box)]

    local = {(r, n): region(full[n], t.box(r)).clone() for n, t in trainer.items() for r in t.mesh_ranks
             if t.box(r) is not None}
    received = {(r, n): torch.full([b - a for a, b in t.box(r)], float("nan")) for n, t in generator.items()
                for r in t.mesh_ranks}
    for piece in plan.pieces:
        region(received[piece.dst, piece.name], piece.dst_slices).copy_(
            region(local[piece.src, piece.name], piece.src_slices))
    for (r, n), tensor in received.items():
        assert torch.equal(tensor, region(full[n], generator[n].box(r))), (r, n)
    moved = sum(torch.Size(p.shape).numel() for p in plan.pieces)
    held = sum(region(full[n], t.box(r)).numel() for n, t in generator.items() for r in t.mesh_ranks)
    assert moved == held  # nothing sent twice, nothing missing
