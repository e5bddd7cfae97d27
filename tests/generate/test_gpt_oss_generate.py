"""GPT-OSS generation: greedy tokens equal transformers' ``generate`` (fp32) with sinks in cached and
decode attention and sliding-window layers, prompts of mixed lengths (some longer than the window)
decoded together (continuous batching), cache block sizes the window does not divide.

Same set-up and margin guard as tests/generate/test_hf_parity.py (whose helpers this reuses).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from tests.generate.conftest import tiny_model  # noqa: E402
from tests.generate.test_hf_parity import MIN_MARGIN, hf_from_lockstep, hf_greedy, random_prompts  # noqa: E402

WINDOW = 6
#: 1 token, under the window, past it, and past it by several blocks of 4
LENGTHS = [1, 5, 11, 23]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    model = tiny_model("gpt_oss", seed=1, sliding_window=WINDOW, n_layers=3)
    hf = hf_from_lockstep(model, tmp_path_factory.mktemp("gpt_oss"))
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=2)
    reference = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for want, _, margin in reference:
        assert margin >= MIN_MARGIN, f"near-tie in the reference (margin {margin:.2g}); change the seed"
    assert len({tuple(want) for want, _, _ in reference}) == len(prompts)  # not a degenerate model
    return model, prompts, reference


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_match_transformers(model_and_reference, block_size):
    model, prompts, reference = model_and_reference
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=block_size))
    results = engine.generate([Request(prompt_ids=p, sampling=greedy) for p in prompts])
    for result, (want, logprobs, _) in zip(results, reference):
        assert result.token_ids == want
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
    # the sliding layers (0 and 2) held a ring of (6 - 1) // bs + 2 blocks per sequence, fewer slots
    # than the longest sequence (23 + 14 tokens): blocks past the window were reused
    span = (WINDOW - 1) // block_size + 2
    assert engine.cache.window_span == span and span * block_size < max(LENGTHS) + NEW_TOKENS
    sliding, full = engine.cache.layer("0").pools[0], engine.cache.layer("1").pools[0]
    assert sliding.shape[0] == engine.config.max_batch_size * span + 1 < full.shape[0]
    assert engine.cache.window_allocator.num_free == engine.config.max_batch_size * span  # all returned


def test_continuous_batching_matches_transformers(model_and_reference):
    """Two batch slots for four requests of different lengths: requests join while others decode
    (and reuse the blocks, full and sliding, that the finished ones released)."""
    model, prompts, reference = model_and_reference
    budgets = [NEW_TOKENS, 5, 9, NEW_TOKENS]
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, block_size=4, max_batch_size=2))
    requests = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=n, temperature=0))
                for p, n in zip(prompts, budgets)]
    for result, (want, _, _), n in zip(engine.generate(requests), reference, budgets):
        assert result.token_ids == want[:n]
