"""``compile_decode``: the decode step under torch.compile computes what eager does, as one graph.

Only ``aot_eager`` runs here (a traced graph, no code generation: ~2 s on a debug model; bitwise
equal to eager on CPU for the same shapes, but the compiled step pads each context to a power of two
blocks, which changes float rounding: logprobs within 1e-5, same tokens). Inductor is not run in the suite: its cold compile of
the decode step of the same model took ~10 s per batch bucket on this 2-vCPU machine (see the
report in docs/generation.md); the option itself is validated in test_errors.py.
"""

from __future__ import annotations

import torch

from lockstep.generate import Request, SamplingParams

from .conftest import engine_for, prompts, tiny_model


def test_aot_eager_decode_is_bitwise_eager_and_follows_weight_updates():
    model = tiny_model("qwen3")
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0.8, seed=i))
            for i, p in enumerate(prompts([3, 7]))]
    eager = engine_for(model, max_batch_size=2)
    compiled = engine_for(model, max_batch_size=2, compile_decode="aot_eager")
    close = lambda a, b: torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)  # noqa: E731
    before = eager.generate(reqs)
    for a, b in zip(before, compiled.generate(reqs)):
        assert a.token_ids == b.token_ids
        close(a.logprobs, b.logprobs)
    # in-place weight updates (an RL trainer between rollouts) reach the compiled step
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight.mul_(-1.5)
    after = eager.generate(reqs)
    assert [r.logprobs for r in after] != [r.logprobs for r in before]
    for a, b in zip(after, compiled.generate(reqs)):
        assert a.token_ids == b.token_ids
        close(a.logprobs, b.logprobs)
    # a batch of 3 is padded to the bucket of 4 (padding rows attend the null block only)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    reqs3 = [Request(prompt_ids=p, sampling=greedy) for p in prompts([2, 5, 9])]
    eager4 = engine_for(model, max_batch_size=4)
    compiled4 = engine_for(model, max_batch_size=4, compile_decode="aot_eager")
    for a, b in zip(eager4.generate(reqs3), compiled4.generate(reqs3)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)


def test_decode_step_compiles_into_one_graph_per_bucket():
    """The cached attention is traced too (no graph break per layer): one frame, one graph for a
    (batch, context) bucket, however many decode steps run in it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama3")
    engine = engine_for(model, max_batch_size=2, block_size=16, compile_decode="aot_eager")
    # prompts of 5 and 7 tokens + 6 new: contexts within 1 block, one batch bucket of 2
    engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0))
                     for p in prompts([5, 7])])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_engine_raises_the_recompile_limit_for_its_own_calls_only():
    """Constructing or running a compiling engine leaves dynamo's process-wide recompile limit as it
    was; inside its compiled calls the limit is raised, so buckets past the process's limit still
    compile (with fail_on_recompile_limit_hit, a bucket over the limit would raise)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiled entries of other engines share the code object and its count
    counters.clear()
    model = tiny_model("llama3")
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        engine = engine_for(model, max_batch_size=2, block_size=16, compile_decode="aot_eager")
        assert torch._dynamo.config.recompile_limit == 1
        # two sequences decode together (bucket of 2 rows), then the longer one alone (1 row)
        engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=n, temperature=0))
                         for p, n in zip(prompts([5, 7]), (2, 5))])
        assert torch._dynamo.config.recompile_limit == 1
    assert counters["stats"]["unique_graphs"] == 2


def test_compiled_prefill_pads_to_buckets_and_matches_eager():
    """``compile_prefill`` (aot_eager here; on by default only with Inductor): one-shot prefills run
    as one graph per (rows, columns) bucket; rows and columns are padded (3 prompts -> 4 rows, 9
    columns -> 16), so float rounding moves (GEMM/attention shapes): logprobs within 1e-5, same
    tokens. Chunked prefills longer than a chunk stay eager; a bad flag names its field."""
    import pytest

    from torch._dynamo.utils import counters

    from lockstep.config.base import ConfigError
    from lockstep.generate import EngineConfig

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama3", n_layers=1)
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    eager = engine_for(model, max_batch_size=4)
    compiled = engine_for(model, max_batch_size=4, compile_decode="aot_eager", compile_prefill=True)
    assert engine_for(model, compile_decode="aot_eager")._prefill_forward is None  # default: Inductor only
    for lengths in ([2, 5, 9], [11, 3, 14]):  # the second batch: same (4, 16) bucket, no new graph
        reqs = [Request(prompt_ids=p, sampling=greedy) for p in prompts(lengths)]
        for a, b in zip(eager.generate(reqs), compiled.generate(reqs)):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
    assert ("prefill", 4, 16) in compiled._guarded
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2, graphs  # prefill (4 rows, 16 columns), decode (4 rows, 4 blocks: contexts <= 16)
    chunked = engine_for(model, max_batch_size=4, compile_decode="aot_eager", compile_prefill=True, prefill_chunk=4)
    reqs = [Request(prompt_ids=p, sampling=greedy) for p in prompts([2, 9])]
    for a, b in zip(eager.generate(reqs), chunked.generate(reqs)):
        assert a.token_ids == b.token_ids
    assert not any(k[0] == "prefill" for k in chunked._guarded)  # 9 tokens in chunks of 4: eager
    with pytest.raises(ConfigError, match="compile_prefill"):
        EngineConfig(compile_prefill="yes").validate()
