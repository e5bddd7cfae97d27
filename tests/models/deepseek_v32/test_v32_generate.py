"""DeepSeek-V3.2 generation: greedy tokens equal transformers' ``generate`` (fp32), with the indexer's
keys cached beside the MLA latent and its top-k selection redone over each sequence's cached context
at every prefill and decode step.

Same set-up and margin guard as tests/generate/test_hf_parity.py (whose helpers this reuses): the
debug flavor (top-8 of up to 39 keys) with large random weights, prompts of mixed lengths decoded
together, cache blocks of 4 and 16, and continuous batching.

The top-k is discrete too: where the 8th and 9th best index scores of a query tie (or nearly), two
correct implementations may keep different keys (transformers' ``topk`` breaks exact ties its own
way). The fixture therefore also asserts a selection margin >= MIN_SELECTION_MARGIN on every query
of the reference sequences (as MIN_MARGIN guards the greedy choice). ``tiny_model`` draws every 1-D
parameter near 1, which gives the indexer's LayerNorm a bias along one direction that makes many
keys score exactly 0; the bias is redrawn small.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lockstep.generate import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from tests.generate.conftest import tiny_model  # noqa: E402
from tests.generate.test_hf_parity import MIN_MARGIN, hf_from_lockstep, hf_greedy, random_prompts  # noqa: E402

LENGTHS = [1, 5, 11, 23]
NEW_TOKENS = 16
#: index scores agree to ~1e-6 in fp32; a boundary gap 100x that cannot swap kept keys
MIN_SELECTION_MARGIN = 1e-4


@torch.no_grad()
def selection_margin(model, tokens: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th best causal index scores of any query (with more
    than k keys) of any layer, in a full forward over ``tokens``."""
    scores = []
    hooks = [block.attention.indexer.register_forward_hook(lambda m, a, out: scores.append(out[1][0]))
             for block in model.layers.values()]
    model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    k, n = model.config.attention.indexer.topk, len(tokens)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    gaps = [s.masked_fill(~causal, float("-inf")).sort(-1, descending=True).values[k:, [k - 1, k]] for s in scores]
    return min(float((g[:, 0] - g[:, 1]).min()) for g in gaps) if n > k else float("inf")


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    model = tiny_model("deepseek_v32", seed=1, n_mtp=0)  # transformers runs no MTP head when generating
    assert model.config.attention.indexer.topk == 8
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in model.layers.values():
            bias = block.attention.indexer.k_norm.bias
            bias.copy_(0.2 * torch.randn(bias.shape, generator=gen))
    hf = hf_from_lockstep(model, tmp_path_factory.mktemp("deepseek_v32"))
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=4)
    reference = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for prompt, (want, _, margin) in zip(prompts, reference):
        assert margin >= MIN_MARGIN, f"near-tie in the reference (margin {margin:.2g}); change the seed"
        gap = selection_margin(model, prompt + want)
        assert gap >= MIN_SELECTION_MARGIN, f"near-tie in the top-k (gap {gap:.2g}); change the seed"
    assert len({tuple(want) for want, _, _ in reference}) == len(prompts)  # not a degenerate model
    return model, prompts, reference


def _greedy(model, prompts, budgets, **config):
    engine = Engine(model, None, EngineConfig(cache_memory_mb=4, **config))
    results = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=n, temperature=0))
                               for p, n in zip(prompts, budgets)])
    return engine, results


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_match_transformers(model_and_reference, block_size):
    model, prompts, reference = model_and_reference
    engine, results = _greedy(model, prompts, [NEW_TOKENS] * len(prompts), block_size=block_size)
    for prompt, result, (want, logprobs, _) in zip(prompts, results, reference):
        where = f"block_size {block_size}, prompt of {len(prompt)} tokens"
        assert result.token_ids == want, where
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0,
                                   msg=lambda m: f"{where}: {m}")
    for name in model.layers:  # the indexer's keys live beside the latent, in the same blocks
        layer = engine.cache.layer(name)
        assert layer.layout.index_dim == 16 and len(layer.pools) == 2
        assert layer.pools[1].shape[:2] == layer.pools[0].shape[:2] and layer.pools[1].shape[2] == 16
        assert layer.pools[1].abs().sum() > 0


def test_continuous_batching_matches_transformers(model_and_reference):
    """Two batch slots for four requests: requests join while others decode, reusing freed blocks."""
    model, prompts, reference = model_and_reference
    budgets = [NEW_TOKENS, 5, 9, NEW_TOKENS]
    _, results = _greedy(model, prompts, budgets, block_size=4, max_batch_size=2)
    for result, budget, (want, _, _) in zip(results, budgets, reference):
        assert result.token_ids == want[:budget]


def test_sparse_selection_matters_in_generation(model_and_reference):
    """The same weights attending densely (top-k past every context) generate other tokens."""
    model, prompts, reference = model_and_reference
    cfg = model.config
    dense_cfg = dataclasses.replace(cfg, attention=dataclasses.replace(
        cfg.attention, indexer=dataclasses.replace(cfg.attention.indexer, topk=512)))
    dense = type(model)(dense_cfg).eval()
    dense.load_state_dict(model.state_dict())
    _, results = _greedy(dense, prompts[2:], [NEW_TOKENS] * 2, block_size=4)  # the two longest prompts
    assert any(r.token_ids != want for r, (want, _, _) in zip(results, reference[2:]))
