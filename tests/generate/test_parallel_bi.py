"""Batch-invariant mode under tensor parallelism: the trainer's TP-2 scoring == the TP-2 generator, bitwise.

World 2 (gloo). The generator is :func:`lockstep.generate.parallel.shard_for_generation` (TP without
sequence parallelism) run by a :class:`GroupEngine` with ``batch_invariant=True``: four greedy
requests of mixed prompt lengths and a seeded sampled one, ``max_batch_size=2`` (continuous
batching: requests join as others finish, prefill and decode rows share steps). The trainer is the
same weights under the trainer's TP rule (:func:`lockstep.parallel.parallelize.apply_dense_tp`:
sequence parallel, DTensor parameters and activations), scored by
:func:`lockstep.rl.scoring.score_logprobs` on the finished sequences in one padded batch, with
gradients on (the RL learner's forward) -- and its backward runs.

Claims, per family (llama3; qwen3 with q/k norms; qwen3_moe with expert TP) and dtype (fp32, bf16),
and deepseek_v3 (MLA + MoE with shared experts; fp32, scored in eval mode: its MTP training loss
needs the trainer's loss-parallel context): the trainer's log-probabilities ``torch.equal`` the
engine's; the engine's tokens on both ranks are the same. Why it holds: column-parallel layers
compute their columns as one process would (each output its own dot product over all of K),
attention runs per local head, row-parallel partials are summed in rank order
(:class:`lockstep.ops.tp_invariant.OrderedSum`), and the head's logits are whole before the
log-softmax on both sides.

TP 2 vs one process differs (the row-parallel layers split K; asserted not equal), unless the one
process splits its row-parallel sums as TP 2 does (:func:`lockstep.parallel.tp_sums.split_row_parallel_sums`,
dense families): then a one-process trainer equals the TP-2 generator and a one-process generator
(same tokens) the TP-2 trainer, bitwise. Cheap checks without processes: a 4-way split equals two
ranks' 2-way splits summed in rank order (the rule behind TP-a split b/a == TP-b), and MoE blocks
are refused by the split.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from lockstep import numerics
from lockstep.generate import Engine, EngineConfig, Request
from lockstep.generate.parallel import GroupEngine, share_requests, shard_for_generation
from lockstep.models.common.transformer import build_meta_model
from lockstep.models.registry import model_config
from lockstep.ops import batch_invariant as bi
from lockstep.ops.tp_invariant import tree_sum
from lockstep.parallel.launch import finish
from lockstep.parallel.parallelize import apply_dense_tp
from lockstep.parallel.tp_sums import split_row_parallel_sums
from lockstep.rl.scoring import score_logprobs
from tests.generate.conftest import tiny_model
from tests.generate.test_parallel_generate import NEW_TOKENS, _requests

WORLD = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: (family, dtype name); deepseek_v3: MLA (absorbed latent path) + MoE with shared experts, expert TP
CASES = [f"{family}/{name}" for family in ("llama3", "qwen3", "qwen3_moe") for name in DTYPES] + ["deepseek_v3/fp32"]
DENSE = ["llama3", "qwen3"]  # split_row_parallel_sums covers GQA + SwiGLU blocks
ENGINE = dict(cache_memory_mb=2, block_size=4, max_batch_size=2, pack_weights=False, batch_invariant=True)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]




def _case(family: str, dtype: torch.dtype, requests: list[Request], mesh: DeviceMesh) -> dict:
    generator = shard_for_generation(tiny_model(family).to(dtype), tp=WORLD)
    done = GroupEngine(generator, None, EngineConfig(**ENGINE)).generate(requests)
    trainer = tiny_model(family).to(dtype)
    apply_dense_tp(trainer, mesh)  # the trainer's rule: sequence parallel, DTensor parameters
    # train mode, as the learner runs; DeepSeek's MTP training loss under TP needs the trainer's
    # loss-parallel context, which scoring does not set up: its forward is scored in eval mode
    trainer.train(family != "deepseek_v3")
    temps = [r.sampling.temperature or 1.0 for r in requests]
    sequences = [r.prompt_ids + list(d.token_ids) for r, d in zip(requests, done)]
    lengths = [len(r.prompt_ids) for r in requests]
    with numerics.batch_invariant():
        scored = score_logprobs(trainer, sequences, lengths, temperature=temps, full_forward=True)
        torch.cat(scored).sum().backward()
    # every parameter but the MTP layers' (unused by a scoring forward) receives a gradient
    grads = all(p.grad is not None for n, p in trainer.named_parameters() if p.requires_grad and "mtp." not in n)
    out = {"engine": [torch.tensor(d.logprobs) for d in done], "tokens": [list(d.token_ids) for d in done],
           "trainer": [s.detach() for s in scored], "grads": grads}
    if family in DENSE:  # one process with its row-parallel sums split as TP-2's: either side of the pair
        one = split_row_parallel_sums(tiny_model(family).to(dtype), WORLD)
        alone = Engine(one, None, EngineConfig(**dict(ENGINE, pack_weights=True))).generate(requests)  # packed
        out["engine_tp1_split"] = [torch.tensor(d.logprobs) for d in alone]
        out["tokens_tp1_split"] = [list(d.token_ids) for d in alone]
        with torch.no_grad(), numerics.batch_invariant():
            out["trainer_tp1_split"] = score_logprobs(one, sequences, lengths, temperature=temps)
            out["trainer_tp1"] = score_logprobs(tiny_model(family).to(dtype), sequences, lengths, temperature=temps)
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # a loaded CI host
    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    requests = share_requests(_requests(sampled_temperature=0.8) if rank == 0 else None)
    results = {case: _case(case.split("/")[0], DTYPES[case.split("/")[1]], requests, mesh) for case in CASES}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finish(0)  # destroy the process group, then os._exit (an exiting gloo worker can crash otherwise)


@pytest.fixture(scope="module")
def results(computed_once):
    def make(d):
        mp.spawn(_worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, join=True)

    tmp = computed_once("parallel-bi spawn", make)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES)
def test_trainer_tp2_logprobs_equal_generator_tp2_bitwise(results, case):
    for rank, res in enumerate(results):
        got = res[case]
        assert [len(t) for t in got["tokens"]] == NEW_TOKENS + [3]
        for i, (engine, trainer) in enumerate(zip(got["engine"], got["trainer"])):
            assert torch.equal(engine, trainer), (case, rank, i, (engine - trainer).abs().max())
        assert got["grads"]  # the trainer's backward ran through the sharded invariant layers


@pytest.mark.parametrize("case", CASES)
def test_every_rank_generates_the_same_tokens(results, case):
    assert results[0][case]["tokens"] == results[1][case]["tokens"]


@pytest.mark.parametrize("case", [f"{family}/{name}" for family in DENSE for name in DTYPES])
def test_one_process_split_as_tp2_equals_tp2_both_ways(results, case):
    """A one-process model whose row-parallel sums are split two ways (``split_row_parallel_sums``)
    gives TP-2's bits: as the trainer (== the TP-2 generator) and as the generator (== the TP-2
    trainer, same tokens); without the split it does not (fp32 and bf16 alike here)."""
    for res in results:
        got = res[case]
        assert got["tokens_tp1_split"] == got["tokens"]
        for i in range(len(got["engine"])):
            assert torch.equal(got["trainer_tp1_split"][i], got["engine"][i]), (case, i)
            assert torch.equal(got["engine_tp1_split"][i], got["trainer"][i]), (case, i)
        assert not all(torch.equal(a, b) for a, b in zip(got["trainer_tp1"], got["engine"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_sums_compose_across_degrees(dtype):
    """The kernel-level claim behind TP-a split b/a == TP-b: a 4-way split of K equals the rank-order
    tree sum of two ranks' 2-way splits of their halves (a TP-2 layout split as TP-4), bitwise."""
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(shape, generator=gen).to(dtype) for shape in ((7, 128), (48, 128)))
    with numerics.batch_invariant():
        layer = torch.nn.Linear(128, 48, bias=False).to(dtype)
        layer.weight.data.copy_(w)
        numerics.prepare_model(layer)
        layer.k_split = 4
        whole = layer(x)
    halves = [bi.linear(x[:, i * 64:(i + 1) * 64], w[:, i * 64:(i + 1) * 64], k_split=2) for i in range(2)]
    assert torch.equal(whole, tree_sum(halves))
    assert not torch.equal(whole, bi.linear(x, w))  # the split changes the bits: why TP degrees differ


def test_split_refuses_moe_blocks():
    with pytest.raises(ValueError, match=r"layers\.\d+ has GroupedQueryAttention \+ MoE"):
        split_row_parallel_sums(build_meta_model(model_config("qwen3_moe", "debug")), 2)
