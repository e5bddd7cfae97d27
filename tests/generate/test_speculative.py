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

#: every family with MTP depths, in its smallest flavors: deepseek_v3's debug flavors (its other
#: flavors are real sizes) and deepseek_v32's debug flavor (the sparse indexer in every MLA block, the MTP
#: block's too, its keys cached beside the latent; no q-LoRA-less variant: the indexer reads the q latent)
MTP_FLAVORS = [("deepseek_v3", {}), ("deepseek_v3", {"attention": "noqlora"}), ("deepseek_v32", {})]
FLAVOR_IDS = ["v3_debug", "v3_debug_noqlora", "v32_debug"]
LENGTHS = [5, 11, 3, 17]
BUDGETS = [12, 7, 15, 2]  # different budgets: the last drafts fewer tokens near its end


def mtp_model(flavor: tuple[str, dict], **changes):
    import dataclasses

    from lockstep.models.registry import model_config

    family, variant = flavor
    if variant.get("attention") == "noqlora":
        attention = dataclasses.replace(model_config(family, "debug").attention, q_lora_rank=0)
        changes["attention"] = attention
    return tiny_model(family, **changes)


def requests(budgets=BUDGETS, stop=None) -> list[Request]:
    return [Request(prompt_ids=p, request_id=str(i),
                    sampling=SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=stop or []))
            for i, (p, n) in enumerate(zip(prompts(LENGTHS), budgets))]


def generate(model, reqs, **config):
    engine = engine_for(model, max_batch_size=4, **config)
    seen = record_logits(engine)
    results = engine.generate(reqs)
    return engine, results, seen


def record_drafts(engine) -> list:
    """Per draft chain: ``(request_id, tokens generated, the depth-1 MTP output it drafts from)``."""
    speculator, drafted = engine.speculator, []
    own_draft = speculator._draft

    def draft(seqs, hidden):
        drafted.extend((s.request.request_id, len(s.generated), h.clone()) for s, h in zip(seqs, hidden))
        own_draft(seqs, hidden)

    speculator._draft = draft
    return drafted


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


@pytest.mark.parametrize("flavor", MTP_FLAVORS, ids=FLAVOR_IDS)
@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_mtp_greedy_is_token_identical(flavor, draft_tokens):
    model = mtp_model(flavor)
    _, plain, _ = generate(model, requests())
    engine, spec, _ = generate(model, requests(), speculative="mtp", draft_tokens=draft_tokens)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [len(r.token_ids) for r in spec] == BUDGETS
    stats = engine.speculator.stats
    assert stats.drafted > 0 and stats.emitted == sum(BUDGETS) - len(BUDGETS)  # the first token comes from prefill


#: (flavor, n_mtp): two depths on deepseek_v3 only (no released model has them; keeps the suite short)
VERIFY_CASES = [(f, n) for f in MTP_FLAVORS for n in (1, 2) if f[0] == "deepseek_v3" or n == 1]


@pytest.mark.parametrize("flavor,n_mtp", VERIFY_CASES,
                         ids=[f"{FLAVOR_IDS[MTP_FLAVORS.index(f)]}-n_mtp{n}" for f, n in VERIFY_CASES])
def test_verify_with_accepted_drafts(flavor, n_mtp, draft_tokens=3):
    """Oracle drafts: tokens identical, log-probabilities close, and every acceptance length happens."""
    model = mtp_model(flavor, n_mtp=n_mtp)
    _, plain, plain_logits = generate(model, requests())
    engine = engine_for(model, max_batch_size=4, speculative="mtp", draft_tokens=draft_tokens)
    drafted = record_drafts(engine)
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
    check_mtp_cache(model, requests(), spec, drafted)


@torch.no_grad()
def check_mtp_cache(model, reqs, results, drafted) -> None:
    """Depth 1's cache (its latent and, deepseek_v32, its indexer keys) holds the true entries after
    every prefill and verify, whatever drafts were rejected: the output each draft chain starts from
    matches a cache-free MTP forward over the sequence so far."""
    checked = 0
    for request, result in zip(reqs, results):
        prompt = request.prompt_ids
        # one forward per sequence; the appended token gives row L-2 (t_{L-1} beside h_{L-2}) a target,
        # and no earlier row reads it (causal)
        tokens = torch.tensor([prompt + result.token_ids + [0]])
        logits = model.mtp_predictions(tokens)[0][0][0]  # depth 1: row i predicts t_{i+2}
        for request_id, done, hidden in drafted:
            if request_id == result.request_id:
                # fp32; the engine's absorbed-latent attention over the cache vs the cache-free path:
                # same math, other summation order
                torch.testing.assert_close(model.output(hidden), logits[len(prompt) + done - 2],
                                           rtol=0, atol=1e-4)
                checked += 1
    assert checked == len(drafted) > len(results)


def test_stop_token_inside_accepted_drafts():
    model = mtp_model(MTP_FLAVORS[0])
    _, plain, _ = generate(model, requests(budgets=[12] * 4))
    stop = plain[0].token_ids[5]  # a token the first sequence emits mid-way
    _, plain_stop, _ = generate(model, requests(budgets=[12] * 4, stop=[stop]))
    engine = engine_for(model, max_batch_size=4, speculative="mtp", draft_tokens=3)
    with_oracle(engine, {r.request_id: r.token_ids for r in plain})
    spec = engine.generate(requests(budgets=[12] * 4, stop=[stop]))
    assert [(r.token_ids, r.finish_reason) for r in spec] == [(r.token_ids, r.finish_reason) for r in plain_stop]
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] == stop


@pytest.mark.parametrize("flavor", [MTP_FLAVORS[0], MTP_FLAVORS[2]], ids=[FLAVOR_IDS[0], FLAVOR_IDS[2]])
def test_mtp_with_chunked_prefill_and_queueing(flavor):
    """More requests than batch slots (sequences join mid-run), prompts prefilled in chunks (depth 1
    catches up chunk by chunk: its cache checked as in the oracle test)."""
    model = mtp_model(flavor)
    reqs = requests() + [Request(prompt_ids=p, request_id=f"late{i}", sampling=SamplingParams(
        max_new_tokens=6, temperature=0.0)) for i, p in enumerate(prompts([9, 4], seed=1))]
    plain = engine_for(model, max_batch_size=3).generate(reqs)
    engine = engine_for(model, max_batch_size=3, speculative="mtp", draft_tokens=2, prefill_chunk=4)
    drafted = record_drafts(engine)
    spec = engine.generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    check_mtp_cache(model, reqs, spec, drafted)


def test_mtp_refusals():
    model = mtp_model(MTP_FLAVORS[0])
    engine = engine_for(model, speculative="mtp")
    with pytest.raises(ConfigError, match=r"^sampling.temperature: speculative decoding"):
        engine.add_request(Request(prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.7)))
    with pytest.raises(ConfigError, match=r"^engine.speculative: 'mtp' drafts with the model's.*family llama3 has"):
        engine_for(tiny_model("llama3"), speculative="mtp")
    with pytest.raises(ConfigError, match=r"^engine.speculative: .*this deepseek_v32 model has n_mtp=0"):
        engine_for(tiny_model("deepseek_v32", n_mtp=0), speculative="mtp")


@pytest.mark.parametrize("family,why", [("kimi_k25", "kimi_k25 builds no MTP depths .*forces n_mtp=0"),
                                        ("deepseek_v4", "deepseek_v4 has no MTP depths .*not loaded")],
                         ids=["kimi_k25", "deepseek_v4"])
def test_mtp_refused_on_families_without_mtp(family, why):
    """DeepSeek-V3 derivatives that never have MTP depths: a clear refusal naming the family."""
    from lockstep.models.common.transformer import build_model
    from lockstep.models.registry import model_config

    model = build_model(model_config(family, "debug"), seed=0)  # refused before any weight is read
    with pytest.raises(ConfigError, match=rf"^engine.speculative: 'mtp' drafts .*; {why}.*deepseek_v32"):
        engine_for(model, speculative="mtp")
    with pytest.raises(ConfigError, match=r"^engine.speculative: must be one of"):
        EngineConfig(speculative="eagle").validate()
    with pytest.raises(ConfigError, match=r"^engine.draft_tokens: must be an integer >= 1"):
        EngineConfig(speculative="mtp", draft_tokens=0).validate()
