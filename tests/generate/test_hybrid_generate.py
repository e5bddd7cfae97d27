"""Gated DeltaNet hybrids (qwen3_5 dense and MoE, qwen3_next): greedy generation equals transformers'
``generate`` (fp32). Linear-attention layers keep a per-sequence recurrent state (conv window +
delta-rule state, :mod:`lockstep.generate.recurrent`) beside the paged KV of the full-attention
layers: prompts of mixed lengths prefilled together (right padding must leave each state
untouched), one prompt past a 64-token chunk, continuous batching where finished sequences free
their state slots for newcomers.

Same set-up and margin guard as tests/generate/test_hf_parity.py (whose helpers this reuses).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from lockstep.models.common.transformer import build_model  # noqa: E402
from lockstep.models.registry import model_config  # noqa: E402
from tests.generate.test_hf_parity import MIN_MARGIN, hf_from_lockstep, hf_greedy, random_prompts  # noqa: E402

#: one token, short, spanning blocks, and past one 64-token chunk of the prefill kernel
LENGTHS = [1, 5, 23, 70]
NEW_TOKENS = 10
CASES = [("qwen3_5", "debug"), ("qwen3_5", "debug-moe"), ("qwen3_next", "debug")]


def hybrid_model(family: str, flavor: str, seed: int = 1) -> torch.nn.Module:
    """The flavor at vocab 256, weights re-drawn large (as tests/generate/conftest.tiny_model)."""
    model = build_model(dataclasses.replace(model_config(family, flavor), vocab_size=256), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=gen)) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def model_and_reference(request, tmp_path_factory):
    family, flavor = request.param
    model = hybrid_model(family, flavor)
    hf = hf_from_lockstep(model, tmp_path_factory.mktemp(family))
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=2)
    reference = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for want, _, margin in reference:
        assert margin >= MIN_MARGIN, f"near-tie in the reference (margin {margin:.2g}); change the seed"
    assert len({tuple(want) for want, _, _ in reference}) == len(prompts)  # not a degenerate model
    return model, prompts, reference


def test_greedy_tokens_match_transformers(model_and_reference):
    model, prompts, reference = model_and_reference
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=4))
    assert engine.recurrent is not None and len(engine.recurrent.layers) == 3
    results = engine.generate([Request(prompt_ids=p, sampling=greedy) for p in prompts])
    for result, (want, logprobs, _) in zip(results, reference):
        assert result.token_ids == want
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_continuous_batching_reuses_state_slots(model_and_reference):
    """Two batch slots for four requests of different lengths and budgets: requests join while others
    decode, and take over the state slots (and blocks) that finished ones released."""
    model, prompts, reference = model_and_reference
    budgets = [NEW_TOKENS, 3, 7, NEW_TOKENS]
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=4, max_batch_size=2))
    requests = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=n, temperature=0))
                for p, n in zip(prompts, budgets)]
    for result, (want, _, _), n in zip(engine.generate(requests), reference, budgets):
        assert result.token_ids == want[:n]
    assert sorted(engine.recurrent._free) == [1, 2]  # every slot returned


def test_compiled_decode_matches_eager():
    """compile_decode (aot_eager: the graph capture without inductor's compile time) through the
    recurrent-state reads and writes gives the eager engine's tokens and log-probabilities."""
    model = hybrid_model("qwen3_5", "debug")  # dense: fp32 grouped_mm experts are not compilable
    prompts = random_prompts([3, 9, 2], model.config.vocab_size, seed=5)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    runs = []
    for compile_decode in ("none", "aot_eager"):
        engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=4, compile_decode=compile_decode))
        runs.append(engine.generate([Request(prompt_ids=p, sampling=greedy) for p in prompts]))
    for eager, compiled in zip(*runs):
        assert compiled.token_ids == eager.token_ids
        torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs), atol=1e-5, rtol=0)
