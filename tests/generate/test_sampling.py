"""Per-request sampling: seeded and batch-independent draws, top-k/top-p support, the logprob
contract (``token_logprobs``), stop ids / stop strings / max_new_tokens and finish reasons."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.generate import Request, SamplingParams, sample_next, token_logprobs
from lockstep.generate.sampling import request_generator

from .conftest import FakeTokenizer, engine_for, full_forward_logits, prompts, tiny_model

#: logprobs from the cached path vs token_logprobs of a full forward: the logits agree to ~5e-6
#: (test_cache_parity), log_softmax at T >= 0.5 at most doubles that; measured <= 2e-6
LOGPROB_TOL = 1e-4


def _sampled(seed: int, n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=kw.pop("temperature", 1.0), seed=seed, **kw)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    model = tiny_model("qwen3_moe")
    target = Request(prompt_ids=prompts([7])[0], sampling=_sampled(seed=1234, n=10, top_k=50, top_p=0.95),
                     request_id="target")
    alone = engine_for(model).generate([target])[0]
    # same request, sharing prefill and decode batches with others of other lengths and params
    others = [Request(prompt_ids=p, sampling=_sampled(seed=s, n=n, temperature=t))
              for p, s, n, t in zip(prompts([2, 13, 5], seed=7), [1, 2, 3], [4, 12, 7], [0.7, 1.3, 0.0])]
    crowded = engine_for(model, max_batch_size=4).generate([others[0], target, others[1], others[2]])[1]
    # joining late, into a running batch, after the others consumed draws from their own generators
    engine = engine_for(model, max_batch_size=4)
    for r in others:
        engine.add_request(r)
    engine.step()
    engine.step()
    late = engine.generate([target])[0]
    assert alone.token_ids == crowded.token_ids == late.token_ids
    torch.testing.assert_close(torch.tensor(crowded.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=LOGPROB_TOL)
    # and a different seed draws something else (10 tokens from a ~250-token support)
    other_seed = engine_for(model).generate([Request(prompt_ids=target.prompt_ids, sampling=_sampled(seed=99, n=10))])
    assert other_seed[0].token_ids != alone.token_ids


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 0.9), (1.5, 3, 1.0)])
def test_logprobs_are_token_logprobs_of_a_full_forward(family, temperature, top_k, top_p):
    """The trainer's recomputation: full-sequence logits, the request's T (1 when greedy), no top-k/top-p."""
    model = tiny_model(family)
    sp = [SamplingParams(max_new_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
          for i, n in enumerate([6, 9])]
    prompt_list = prompts([4, 10])
    results = engine_for(model).generate([Request(prompt_ids=p, sampling=s) for p, s in zip(prompt_list, sp)])
    t = temperature if temperature > 0 else 1.0
    for prompt, result in zip(prompt_list, results):
        logits = full_forward_logits(model, prompt, result.token_ids)
        want = token_logprobs(logits, torch.tensor(result.token_ids), t)
        torch.testing.assert_close(torch.tensor(result.logprobs), want, rtol=0, atol=LOGPROB_TOL)
        if top_k:  # not the top-k renormalised distribution the token was drawn from: that one is larger
            kth = (logits / t).topk(top_k, dim=-1).values[:, -1:]
            truncated = token_logprobs((logits / t).masked_fill(logits / t < kth, float("-inf")),
                                       torch.tensor(result.token_ids))
            assert bool((truncated - want > 1e-3).all())


def test_token_logprobs_is_the_untruncated_tempered_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0]])
    ids = torch.tensor([1, 2])
    for t in (1.0, 0.5, 2.0):
        want = torch.log_softmax(logits / t, dim=-1)[torch.arange(2), ids]
        assert torch.equal(token_logprobs(logits, ids, t), want)
    # T = 0 (greedy) scores under the model's own distribution, T = 1
    assert torch.equal(token_logprobs(logits, ids, 0.0), token_logprobs(logits, ids, 1.0))
    assert torch.equal(token_logprobs(logits, ids, torch.tensor([0.0, 0.5])),
                       token_logprobs(logits, ids, torch.tensor([1.0, 0.5])))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        token_logprobs(logits, ids, -1.0)
    per_row = token_logprobs(logits, ids, torch.tensor([1.0, 0.5]))
    assert torch.equal(per_row[0], token_logprobs(logits[0], ids[0], 1.0))
    assert torch.equal(per_row[1], token_logprobs(logits[1], ids[1], 0.5))
    # [B, T, V] logits with [B, T] ids (a trainer scoring whole rollouts)
    assert token_logprobs(logits[None].expand(3, 2, 4), ids[None].expand(3, 2), 1.0).shape == (3, 2)
    # sample_next reports the same number even when top-k restricted the draw
    params = [SamplingParams(temperature=0.5, top_k=2, seed=0), SamplingParams(temperature=0)]
    tokens, logprobs = sample_next(logits, params, [request_generator(0), None])
    assert torch.equal(logprobs, token_logprobs(logits, tokens, torch.tensor([0.5, 1.0])))
    assert tokens[1] == 2  # greedy: argmax


def test_greedy_takes_argmax_first_index_among_ties_and_nan():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (32, 1000), generator=gen).float()  # many exact ties per row
    logits[5, 17] = float("nan")
    logits[6] = float("-inf")
    tokens, _ = sample_next(logits, [SamplingParams(temperature=0)] * 32, [None] * 32)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[5] == 17 and tokens[6] == 0


def _draw(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    params = [SamplingParams(seed=i, **kw) for i in range(n)]
    return sample_next(logits.expand(n, -1), params, [request_generator(i) for i in range(n)])[0]


def test_top_k_and_top_p_restrict_the_support_and_keep_the_proportions():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    probs = torch.softmax(logits[0], -1)
    n = 4000
    all_tokens = _draw(logits, n, temperature=1.0)
    assert set(all_tokens.tolist()) == set(range(8))  # untruncated: every token shows up (p_min = 0.4%)
    top3 = _draw(logits, n, temperature=1.0, top_k=3)
    assert set(top3.tolist()) == {0, 1, 2}
    # nucleus: the smallest prefix with mass >= 0.8 (cumulative 0.42, 0.68, 0.83 -> 3 tokens)
    cum = probs.cumsum(0)
    assert cum[1] < 0.8 <= cum[2]
    nucleus = _draw(logits, n, temperature=1.0, top_p=0.8)
    assert set(nucleus.tolist()) == {0, 1, 2}
    # within the support, frequencies follow the renormalised probabilities (binomial sd <= 0.008; 5 sd)
    freq = torch.bincount(top3, minlength=8)[:3].double() / n
    torch.testing.assert_close(freq, (probs[:3] / probs[:3].sum()).double(), rtol=0, atol=0.04)
    assert set(_draw(logits, 200, temperature=1.0, top_k=1).tolist()) == {0}
    assert set(_draw(logits, 200, temperature=1.0, top_p=0.01).tolist()) == {0}
    # temperature sharpens: T=0.25 puts most mass on the top token
    cold = _draw(logits, n, temperature=0.25)
    assert (cold == 0).double().mean() > 0.8


def test_sampled_tokens_are_the_same_for_the_same_seed_in_sample_next():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(seed=s, top_p=0.9) for s in (5, 6, 7)]
    a = sample_next(logits, params, [request_generator(p.seed) for p in params])[0]
    b = sample_next(logits, params, [request_generator(p.seed) for p in params])[0]
    # row 1 alone, without the others
    c = sample_next(logits[1:2], params[1:2], [request_generator(6)])[0]
    assert torch.equal(a, b) and a[1] == c[0]


def test_max_new_tokens_and_length_finish():
    model = tiny_model("llama3")
    [r] = engine_for(model).generate([Request(prompt_ids=prompts([3])[0], sampling=_sampled(seed=0, n=5))])
    assert len(r.token_ids) == len(r.logprobs) == 5 and r.finish_reason == "length" and r.text == ""
    # the model's context caps the budget too: max_seq_len 512, a 510-token prompt gets 3 tokens
    [r] = engine_for(model, cache_memory_mb=8).generate([Request(prompt_ids=[1] * 510, sampling=_sampled(seed=0, n=9))])
    assert len(r.token_ids) == 3 and r.finish_reason == "length"


def test_stop_token_ids_end_the_sequence_and_are_returned():
    model = tiny_model("llama3")
    prompt = prompts([5])[0]
    [free] = engine_for(model).generate([Request(prompt_ids=prompt, sampling=_sampled(seed=3, n=12))])
    stop_at = 4
    stop_id = free.token_ids[stop_at]
    first = free.token_ids.index(stop_id)  # the first occurrence ends it
    stopping = _sampled(seed=3, n=12, stop_token_ids=[stop_id])
    [r] = engine_for(model).generate([Request(prompt_ids=prompt, sampling=stopping)])
    assert r.token_ids == free.token_ids[: first + 1] and r.finish_reason == "stop"
    assert r.logprobs == free.logprobs[: first + 1]
    # with a tokenizer, its eos stops too, unless ignore_eos; the stop token is not in the text
    tok = FakeTokenizer()
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    [g] = engine_for(model).generate([Request(prompt_ids=prompt, sampling=greedy)])
    tok.eos_id = g.token_ids[2]
    first = g.token_ids.index(tok.eos_id)
    [r] = engine_for(model, tokenizer=tok).generate([Request(prompt_ids=prompt, sampling=greedy)])
    assert r.token_ids == g.token_ids[: first + 1] and r.finish_reason == "stop"
    assert r.text == tok.decode(g.token_ids[:first])
    ignore = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    [r] = engine_for(model, tokenizer=tok).generate([Request(prompt_ids=prompt, sampling=ignore)])
    assert r.token_ids == g.token_ids and r.finish_reason == "length"


def test_stop_strings_cut_the_text_and_end_the_sequence():
    model = tiny_model("llama3")
    tok = FakeTokenizer()
    tok.eos_id = -1  # no eos in this test
    prompt = prompts([5])[0]
    greedy = dict(max_new_tokens=16, temperature=0)
    [g] = engine_for(model, tokenizer=tok).generate([Request(prompt_ids=prompt, sampling=SamplingParams(**greedy))])
    full = g.text
    assert full == tok.decode(g.token_ids) and len(full) == 16
    stop = full[5:8]  # a 3-character stop string completed by token 7
    start = full.index(stop)
    [r] = engine_for(model, tokenizer=tok).generate(
        [Request(prompt_ids=prompt, sampling=SamplingParams(**greedy, stop=["zzzzzz", stop]))])
    assert r.finish_reason == "stop"
    assert r.text == full[:start]
    assert r.token_ids == g.token_ids[: start + len(stop)]  # tokens up to the one completing the stop string
    # streamed deltas add up to the final text, and never show the stop string
    events = list(engine_for(model, tokenizer=tok).stream(
        [Request(prompt_ids=prompt, sampling=SamplingParams(**greedy, stop=[stop]))]))
    assert "".join(e.text for e in events) == full[:start]
    assert [e.token_id for e in events] == r.token_ids and events[-1].finished and not events[0].finished


def test_text_prompts_and_stream_indices():
    model = tiny_model("llama3")
    tok = FakeTokenizer()
    tok.eos_id = -1
    engine = engine_for(model, tokenizer=tok)
    reqs = [Request(prompt="hello", sampling=SamplingParams(max_new_tokens=3, temperature=0), request_id="a"),
            Request(prompt_ids=tok.encode("hello"), sampling=SamplingParams(max_new_tokens=5, temperature=0),
                    request_id="b")]
    events = list(engine.stream(reqs))
    by_index = {i: [e for e in events if e.index == i] for i in (0, 1)}
    assert [len(v) for v in by_index.values()] == [3, 5]
    assert by_index[0][-1].result.token_ids == by_index[1][-1].result.token_ids[:3]  # same prompt, greedy
    assert by_index[1][-1].result.request_id == "b" and by_index[0][-1].result.prompt_ids == tok.encode("hello")
    assert all(math.isfinite(e.logprob) and e.logprob <= 0 for e in events)


def test_leaving_a_stream_early_aborts_its_requests():
    model = tiny_model("llama3")
    engine = engine_for(model, num_blocks=10)
    stream = engine.stream([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=20, temperature=0))
                            for p in prompts([4, 6])])
    next(stream)
    stream.close()
    assert not engine.has_unfinished and engine.cache.allocator.num_free == 10
