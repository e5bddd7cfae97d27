"""Tensor/expert-parallel generation (lockstep.generate.parallel) over world 2 (gloo) == one process.

Tiny fp32 models (tests/generate/conftest.py ``tiny_model``: weights at std 0.15, logits O(5), so
greedy argmaxes are far from ties), four greedy requests of mixed prompt lengths and a seeded sampled
one with ``max_batch_size=2`` (continuous batching: requests join as others finish). Claims:

- TP 2 (llama3, qwen3 with q/k norms and chunked prefill, deepseek_v3 MLA + MoE with shared experts
  and expert TP, qwen3_moe expert TP, gpt_oss sinks / sliding window / biases) and EP 2 (qwen3_moe,
  deepseek_v3, gpt_oss with expert biases) give the one-process greedy tokens, and
  log-probabilities within 1e-4 (fp32: the sharded sums and all-reduces round in another order,
  measured ~1e-6; a wrong head, expert or KV-cache slice moves them by O(1));
- every rank returns the same results (rank 0's samples are broadcast; a sampled request included);
- ``lockstep generate --tp 2`` (the torchrun worker path) prints the one-process completion, once;
- batch-invariant mode at EP 2 gives one process's log-probabilities bit for bit (qwen3_moe);
- the parameters are DTensors whose gathered values equal the one-process weights (torch.equal),
  with the placements of the module docstring, and a rank's KV cache holds its KV heads only.

One spawn runs every case (``computed_once``); each one-process reference runs on one of the two
ranks (alternating), the sharded engines on both. Layout errors and refused engine options are
checked without processes (they need no group).
"""

import contextlib
import datetime
import io
import json
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard

from lockstep.config.base import ConfigError
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.generate.cache import layer_layouts
from lockstep.generate.parallel import (
    GroupEngine,
    check_generation_layout,
    check_group_engine_config,
    generator_layout,
    share_requests,
    shard_for_generation,
)
from lockstep.models.common.transformer import build_meta_model
from lockstep.models.registry import model_config
from tests.generate.conftest import prompts, tiny_model
from tests.test_cli_generate import make_model_dir

WORLD = 2
#: (family, layout): the layouts the issue asks for, and GPT-OSS (sinks, sliding window, biases, expert biases)
CASES = [("llama3", "tp"), ("qwen3", "tp"), ("deepseek_v3", "tp"), ("qwen3_moe", "tp"), ("qwen3_moe", "ep"),
         ("deepseek_v3", "ep"), ("gpt_oss", "tp"), ("gpt_oss", "ep")]
#: engine options of a case beside ENGINE (the reference runs them too)
EXTRA = {("qwen3", "tp"): {"prefill_chunk": 4}}  # chunked prefill under TP
ENGINE = dict(cache_memory_mb=2, block_size=4, max_batch_size=2, pack_weights=False)
LENGTHS = [3, 9, 12, 6]
NEW_TOKENS = [5, 3, 4, 5]
LOGPROB_TOL = 1e-4  # fp32 sums in another order (module docstring)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]


def _requests(sampled_temperature: float = 1.0) -> list[Request]:
    """Four greedy requests of mixed prompt lengths and one seeded sampled request."""
    reqs = [Request(prompt_ids=p, request_id=str(i),
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts(LENGTHS, seed=3), NEW_TOKENS))]
    reqs.append(Request(prompt_ids=prompts([4], seed=4)[0], request_id="sampled",
                        sampling=SamplingParams(temperature=sampled_temperature, max_new_tokens=3, seed=11,
                                                ignore_eos=True)))
    return reqs


def _run(engine: Engine, requests: list[Request]) -> dict[str, tuple[list[int], list[float]]]:
    return {r.request_id: (list(r.token_ids), list(r.logprobs)) for r in engine.generate(requests)}


def _layout_facts(family: str, kind: str, model) -> dict:
    """Placements of a few parameters, gathered DTensors == the one-process weights, cache heads."""
    layout = generator_layout(model)
    reference = dict(tiny_model(family).named_parameters())
    equal = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), reference[name])
                for name, p in model.named_parameters())
    sharded = sorted(name for name, (_, mesh, _) in layout.items() if mesh is not None)
    placements = {name: layout[name][2] for name in layout
                  if name.endswith(("attention.wq.weight", "attention.wo.weight", "attention.wkv_b.weight",
                                    "attention.wkv_a.weight", "experts.w1", "experts.w2", "attention_norm.weight",
                                    "tok_embeddings.weight"))}
    heads = {layer: lay.heads for layer, lay in layer_layouts(model).items()}
    return {"equal": equal, "sharded": sharded, "placements": placements, "heads": heads}


def _cli_json(*argv: str) -> str:
    from lockstep.cli_generate import cmd_generate

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cmd_generate(["--prompt", "To be, or not", "--max-new-tokens", "6", "--json", *argv]) == 0
    return out.getvalue()


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # a loaded CI host
    results = {}
    requests = share_requests(_requests() if rank == 0 else None)
    for i, (family, kind) in enumerate(CASES):
        config = dict(ENGINE, **EXTRA.get((family, kind), {}))
        if i % world == rank:  # one rank computes each one-process reference
            results[f"{family}/{kind}/reference"] = _run(Engine(tiny_model(family), None, EngineConfig(**config)),
                                                         requests)
        model = shard_for_generation(tiny_model(family), **{kind: world})
        results[f"{family}/{kind}"] = _run(GroupEngine(model, None, EngineConfig(**config)), requests)
        results[f"{family}/{kind}/layout"] = _layout_facts(family, kind, model)
    # batch-invariant mode under EP: the experts' rows in fixed tiles, the share sums a + b
    bi = EngineConfig(**ENGINE, batch_invariant=True)
    if rank == 1:
        results["bi/reference"] = _run(Engine(tiny_model("qwen3_moe"), None, bi), requests)
    results["bi"] = _run(GroupEngine(shard_for_generation(tiny_model("qwen3_moe"), ep=world), None, bi), requests)
    # `lockstep generate --tp 2` as a torchrun worker would run it (the group handed in), rank 0 printing
    model_dir = os.path.join(out_dir, "model")
    if rank == 0:
        results["cli/reference"] = _cli_json("--checkpoint", model_dir)
    os.environ["WORLD_SIZE"] = str(world)
    results["cli"] = _cli_json("--checkpoint", model_dir, "--tp", str(world))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def results(computed_once):
    def make(d):
        make_model_dir(d / "model")  # the generate CLI tests' tiny llama3 with a tokenizer
        mp.spawn(_worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, join=True)

    tmp = computed_once("parallel-generate spawn", make)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _reference(results, case: str):
    return next(r[f"{case}/reference"] for r in results if f"{case}/reference" in r)


@pytest.mark.parametrize("family,kind", CASES)
def test_sharded_greedy_tokens_equal_one_process(results, family, kind):
    case = f"{family}/{kind}"
    reference = _reference(results, case)
    for rank, res in enumerate(results):
        got = res[case]
        for rid, (tokens, logprobs) in reference.items():
            if rid == "sampled":
                continue
            assert got[rid][0] == tokens, (case, rank, rid)
            assert len(tokens) == NEW_TOKENS[int(rid)]
            assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < LOGPROB_TOL, (case, rank, rid)


@pytest.mark.parametrize("family,kind", CASES)
def test_every_rank_returns_the_same_results(results, family, kind):
    case = f"{family}/{kind}"
    assert results[0][case] == results[1][case]  # the sampled request too: rank 0's draws are everyone's
    assert len(results[0][case]["sampled"][0]) == 3


def test_generate_cli_tp2_prints_the_one_process_completion_once(results):
    reference = json.loads(results[0]["cli/reference"])
    got = json.loads(results[0]["cli"])
    assert got["token_ids"] == reference["token_ids"] and len(got["token_ids"]) == 6
    assert max(abs(a - b) for a, b in zip(got["logprobs"], reference["logprobs"])) < LOGPROB_TOL
    assert results[1]["cli"] == ""  # only group rank 0 prints


def test_ep_batch_invariant_logprobs_are_bitwise_one_process(results):
    """Batch-invariant mode, qwen3_moe (top-2) at ep 2: the log-probabilities equal one process's bit for
    bit (each expert's rows in fixed tiles; a token's two expert outputs summed as a + b either way)."""
    reference = _reference(results, "bi")
    for res in results:
        assert res["bi"] == reference


def test_tp_parameters_are_dtensors_holding_the_one_process_weights(results):
    for res in results:
        llama = res["llama3/tp/layout"]
        assert llama["equal"]
        p = llama["placements"]
        assert p["layers.0.attention.wq.weight"] == (Shard(0),)
        assert p["layers.0.attention.wo.weight"] == (Shard(1),)
        assert p["tok_embeddings.weight"] == (Shard(0),)
        assert p["layers.0.attention_norm.weight"] == ()  # plain: whole on every rank
        assert llama["heads"] == {"0": 1, "1": 1}  # 2 KV heads over tp 2: one cached per rank
        mla = res["deepseek_v3/tp/layout"]
        assert mla["equal"]
        assert mla["placements"]["layers.0.attention.wkv_b.weight"] == (Shard(0),)
        assert mla["placements"]["layers.0.attention.wkv_a.weight"] == ()  # latent projection replicated
        assert mla["placements"]["layers.1.feed_forward.experts.w1"] == (Shard(1),)  # expert TP: hidden dim
        assert mla["placements"]["layers.1.feed_forward.experts.w2"] == (Shard(2),)
        assert set(mla["heads"].values()) == {1}  # the latent cache: one shared "head", replicated


def test_ep_parameters_shard_the_experts_only(results):
    for res in results:
        for family in ("qwen3_moe", "deepseek_v3"):
            facts = res[f"{family}/ep/layout"]
            assert facts["equal"]
            assert facts["sharded"] and all(".experts.w" in n for n in facts["sharded"]), facts["sharded"]
            assert facts["placements"]["layers.1.feed_forward.experts.w1"] == (Shard(0),)
            assert facts["placements"]["layers.0.attention_norm.weight"] == ()
        assert res["qwen3_moe/ep/layout"]["heads"] == {"0": 2, "1": 2}  # attention replicated: every KV head


# ----------------------------------------------------------------- errors (no processes needed)


def _meta(family: str, **changes):
    import dataclasses

    return build_meta_model(dataclasses.replace(model_config(family, "debug"), **changes))


@pytest.mark.parametrize("family,changes,tp,ep,words", [
    ("llama3", {"n_kv_heads": 1}, 2, 1, ["generator_parallel.tp", "n_kv_heads=1"]),
    ("llama3", {"n_heads": 3, "n_kv_heads": 1, "head_dim": 16}, 2, 1, ["generator_parallel.tp", "n_heads=3"]),
    ("llama3", {}, 1, 2, ["generator_parallel.ep", "needs MoE layers"]),
    ("qwen3_moe", {}, 2, 2, ["generator_parallel", "tp x ep = 4 must equal the group's size 2"]),  # both: accepted
    ("qwen3_moe", {}, 3, 1, ["generator_parallel", "group's size 2"]),
    ("qwen3_next", {}, 2, 1, ["generator_parallel.tp", "linear-attention"]),
])
def test_layout_errors_name_the_field(family, changes, tp, ep, words):
    model = _meta(family, **changes)
    with pytest.raises(ConfigError) as err:
        check_generation_layout(model, tp, ep, world=2)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_experts_not_divisible_by_ep():
    from lockstep.models.qwen3_moe.config import qwen3_moe_config

    cfg = qwen3_moe_config("debug", vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                           ffn_dim=192, max_seq_len=64, n_experts=3, top_k=2, moe_ffn_dim=32)
    with pytest.raises(ConfigError, match=r"generator_parallel\.ep: 2 does not divide n_routed_experts=3"):
        check_generation_layout(build_meta_model(cfg), 1, 2, world=2)


@pytest.mark.parametrize("field,value", [("compile_decode", "inductor"), ("weights_dtype", "bfloat16"),
                                         ("speculative", "mtp")])
def test_refused_engine_options_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"engine\.{field}:"):
        check_group_engine_config(EngineConfig(**{field: value}))


def test_batch_invariant_is_an_accepted_group_engine_option():
    check_group_engine_config(EngineConfig(batch_invariant=True))  # TP: tests/generate/test_parallel_bi.py


@pytest.mark.parametrize("flags,message", [
    (["--tp", "2", "--ep", "2"], "--tp/--ep: give one of them"),
    (["--tp", "0"], "--tp: must be >= 1"),
    (["--ep", "2", "--engine", "vllm"], "--tp/--ep: run lockstep's engine"),
])
def test_generate_cli_group_flag_errors(tmp_path, flags, message):
    from lockstep.cli_generate import _parse

    with pytest.raises(ConfigError, match=re.escape(message)):
        _parse("generate", ["--checkpoint", str(tmp_path), "--prompt", "x", *flags])


def test_group_engine_needs_a_sharded_model():
    with pytest.raises(TypeError, match="shard_for_generation"):
        GroupEngine(tiny_model("llama3"), None, EngineConfig(**ENGINE))
