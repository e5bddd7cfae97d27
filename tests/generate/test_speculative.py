"""MTP speculative decoding (lockstep.generate.speculative): greedy output identical to plain decoding.

A random model's MTP head almost never agrees with its main head, so besides its own drafts the
verify path is driven with *oracle* drafts (the plain greedy continuation, corrupted at a place that
differs per sequence and step): every acceptance length from 0 to k occurs, per sequence, in one batch.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.generate import EngineConfig, Request, SamplingParams

from .conftest import VOCAB, engine_for, prompts, record_logits, tiny_model

#: every family flavor with MTP depths (deepseek_v3's debug flavors; its other flavors are real sizes)
MTP_FLAVORS = [{}, {"attention": "noqlora"}]
LENGTHS = [5, 11, 3, 17]
BUDGETS = [12, 7, 15, 2]  # different budgets: the last drafts fewer tokens near its end


def mtp_model(variant: dict, **changes):
    import dataclasses

    from lockstep.models.registry import model_config

    if variant.get("attention") == "noqlora":
        attention = dataclasses.replace(model_config("deepseek_v3", "debug").attention, q_lora_rank=0)
        changes["attention"] = attention
    return tiny_model("deepseek_v3", **changes)


def requests(budgets=BUDGETS, stop=None) -> list[Request]:
    return [Request(prompt_ids=p, request_id=str(i),
                    sampling=SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=stop or []))
            for i, (p, n) in enumerate(zip(prompts(LENGTHS), budgets))]


def generate(model, reqs, **config):
    engine = engine_for(model, max_batch_size=4, **config)
    seen = record_logits(engine)
    results = engine.generate(reqs)
    return engine, results, seen


def with_oracle(engine, plain: dict[str, list[int]]) -> None:
    """Replace the MTP drafts by the plain continuation, one token corrupted at a place that varies
    with the sequence and the step (so acceptance lengths 0..k all occur)."""
    speculator = engine.speculator
    own_draft = speculator._draft

    def draft(seqs, hidden):
        own_draft(seqs, hidden)  # the MTP chain still runs (its cache writes must not matter)
        for seq in seqs:
            done = len(seq.generated)
            drafts = list(plain[seq.request.request_id][done:done + len(speculator.drafts[seq.seq_id])])
            wrong = (done + 2 * int(seq.request.request_id)) % (speculator.draft_tokens + 2)
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % VOCAB
            speculator.drafts[seq.seq_id] = drafts

    speculator._draft = draft


@pytest.mark.parametrize("variant", MTP_FLAVORS, ids=["debug", "debug_noqlora"])
@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_mtp_greedy_is_token_identical(variant, draft_tokens):
    model = mtp_model(variant)
    _, plain, _ = generate(model, requests())
    engine, spec, _ = generate(model, requests(), speculative="mtp", draft_tokens=draft_tokens)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [len(r.token_ids) for r in spec] == BUDGETS
    stats = engine.speculator.stats
    assert stats.drafted > 0 and stats.emitted == sum(BUDGETS) - len(BUDGETS)  # the first token comes from prefill


@pytest.mark.parametrize("variant", MTP_FLAVORS, ids=["debug", "debug_noqlora"])
@pytest.mark.parametrize("n_mtp,draft_tokens", [(1, 3), (2, 3)])
def test_verify_with_accepted_drafts(variant, n_mtp, draft_tokens):
    """Oracle drafts: tokens identical, log-probabilities close, and every acceptance length happens."""
    model = mtp_model(variant, n_mtp=n_mtp)
    _, plain, plain_logits = generate(model, requests())
    engine = engine_for(model, max_batch_size=4, speculative="mtp", draft_tokens=draft_tokens)
    with_oracle(engine, {r.request_id: r.token_ids for r in plain})
    lengths: list[int] = []
    verify = engine.speculator.decode

    def counting(seqs):
        before = [len(s.generated) for s in seqs]
        events = verify(seqs)
        lengths.extend(len(s.generated) - b for s, b in zip(seqs, before))
        return events

    engine.speculator.decode = counting
    spec = engine.generate(requests())
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    # fp32: the verify forward sums over k+1 query rows at once, plain decoding one; same math, other
    # summation order, so log-probabilities agree to float rounding (not bitwise)
    for a, b in zip(spec, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    assert set(lengths) == set(range(1, draft_tokens + 2)), lengths  # 0..k drafts accepted (+1 bonus)
    assert engine.speculator.stats.accepted > 0
    assert len(plain_logits) == 4


def test_stop_token_inside_accepted_drafts():
    model = mtp_model({})
    _, plain, _ = generate(model, requests(budgets=[12] * 4))
    stop = plain[0].token_ids[5]  # a token the first sequence emits mid-way
    _, plain_stop, _ = generate(model, requests(budgets=[12] * 4, stop=[stop]))
    engine = engine_for(model, max_batch_size=4, speculative="mtp", draft_tokens=3)
    with_oracle(engine, {r.request_id: r.token_ids for r in plain})
    spec = engine.generate(requests(budgets=[12] * 4, stop=[stop]))
    assert [(r.token_ids, r.finish_reason) for r in spec] == [(r.token_ids, r.finish_reason) for r in plain_stop]
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] == stop


def test_mtp_with_chunked_prefill_and_queueing():
    """More requests than batch slots (sequences join mid-run), prompts prefilled in chunks."""
    model = mtp_model({})
    reqs = requests() + [Request(prompt_ids=p, request_id=f"late{i}", sampling=SamplingParams(
        max_new_tokens=6, temperature=0.0)) for i, p in enumerate(prompts([9, 4], seed=1))]
    plain = engine_for(model, max_batch_size=3).generate(reqs)
    spec = engine_for(model, max_batch_size=3, speculative="mtp", draft_tokens=2, prefill_chunk=4).generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_mtp_refusals():
    model = mtp_model({})
    engine = engine_for(model, speculative="mtp")
    with pytest.raises(ConfigError, match=r"^sampling.temperature: speculative decoding"):
        engine.add_request(Request(prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.7)))
    with pytest.raises(ConfigError, match=r"^engine.speculative: 'mtp' drafts with the model's"):
        engine_for(tiny_model("llama3"), speculative="mtp")
    with pytest.raises(ConfigError, match=r"^engine.speculative: must be one of"):
        EngineConfig(speculative="eagle").validate()
    with pytest.raises(ConfigError, match=r"^engine.draft_tokens: must be an integer >= 1"):
        EngineConfig(speculative="mtp", draft_tokens=0).validate()
