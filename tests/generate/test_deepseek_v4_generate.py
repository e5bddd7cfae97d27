"""DeepSeek-V4 in lockstep's engine (lockstep/generate/compressed_cache.py): the tiny random debug model
(HCA rate 8, CSA rate 4 with 4 indexer picks, sliding window 8, a hash-routed MoE layer) generates
five prompts of different lengths with continuous batching (more requests than ``max_batch_size``,
different budgets, so sequences join and leave a running batch and reuse its state slots), one-shot
and chunked prefill, entries contiguous in their blocks or not (block size 4 and 6). The greedy
tokens equal transformers' ``generate`` (its own CSA/HCA cache), and every sampled row's logits
equal one whole-sequence forward."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lockstep.generate import Request, SamplingParams
from lockstep.generate.cache import PagedKVCache

from .conftest import engine_for, full_forward_logits, record_logits

pytest.importorskip("transformers")

#: prompt lengths and new-token budgets: the longest run reaches position 40, past 5 HCA and 10 CSA
#: windows (a prompt of one token crosses every boundary while decoding; 16 closes both kinds at its last token)
LENGTHS = [1, 6, 16, 22, 31]
NEW = [10, 6, 9, 4, 10]
#: fp32 logits of size ~15: the cached steps sum in another order than the whole-sequence forward
#: (measured max difference 7e-6); a cache bug (a wrong key, entry or window) moves them by O(1)
ATOL = 1e-4
#: greedy choices closer than this could flip between implementations (fp32 logits agree to ~1e-5)
MIN_MARGIN = 1e-3
CASES = {"one-shot-block4": {"block_size": 4}, "chunk5-block6": {"block_size": 6, "prefill_chunk": 5}}


def _v4_reference():
    """tests/models/deepseek_v4/v4_reference.py (the parity tests' lockstep/transformers pair)."""
    if "v4_reference" not in sys.modules:
        path = Path(__file__).parents[1] / "models" / "deepseek_v4" / "v4_reference.py"
        spec = importlib.util.spec_from_file_location("v4_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["v4_reference"] = module
    return sys.modules["v4_reference"]


@pytest.fixture(scope="module")
def models():
    model, hf = _v4_reference().pair(seed=2)
    with torch.no_grad():  # larger weights: a peaked, non-degenerate next-token distribution
        model.output.weight.mul_(20)
        hf.lm_head.weight.mul_(20)
    return model, hf


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
@torch.no_grad()
def hf_tokens(models, prompts):
    _, hf = models
    return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, use_cache=True,
                        pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, NEW)]


@pytest.fixture(scope="module", params=list(CASES))
def run(request, models, prompts):
    engine = engine_for(models[0], cache_memory_mb=1, max_batch_size=2, pack_weights=False, **CASES[request.param])
    logits = record_logits(engine)
    results = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=n, temperature=0.0))
                               for p, n in zip(prompts, NEW)])
    return results, [torch.stack(logits[i]) for i in range(len(prompts))]


def test_greedy_tokens_equal_transformers_generate(run, hf_tokens):
    results, logits = run
    for rows in logits:
        top2 = rows.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "near-tie in a greedy choice; change the seed"
    got = [r.token_ids for r in results]
    assert [len(t) for t in got] == NEW
    assert len({t for tokens in got for t in tokens}) > 10  # not a degenerate model
    assert got == hf_tokens


def test_prefill_and_decode_logits_equal_full_forward(run, models, prompts):
    results, logits = run
    for prompt, result, rows in zip(prompts, results, logits):
        want = full_forward_logits(models[0], prompt, result.token_ids)
        torch.testing.assert_close(rows, want, atol=ATOL, rtol=0)


def test_cache_layout_per_block(models):
    """Entries take ceil(block_size / rate) rows a block; pure sliding-window blocks cache nothing per token."""
    engine = engine_for(models[0], cache_memory_mb=1, block_size=4, max_batch_size=2, pack_weights=False)
    layouts = engine.cache.layouts  # debug layers: HCA (rate 8), CSA (rate 4, indexer 16 wide), sliding, CSA
    assert [(lay.kind, lay.key_dim, lay.index_dim, lay.rate) for lay in layouts.values()] == [
        ("compressed", 32, 0, 8), ("compressed", 32, 16, 4), ("compressed", 0, 0, 1), ("compressed", 32, 16, 4)]
    assert PagedKVCache.bytes_per_block(layouts, 4, torch.float32) == 4 * (32 + 48 + 0 + 48)
    assert PagedKVCache.bytes_per_block(layouts, 16, torch.float32) == 4 * (2 * 32 + 2 * 4 * 48)
    # rings per slot (3 slots): window 8 x 32 per layer; compressors kv + gate of span x width
    rings = 8 * 32 * 4 + 2 * (8 * 32) + 2 * 2 * (8 * 64 + 8 * 32)
    assert engine.recurrent.nbytes == 3 * 4 * rings


def test_engine_refuses_batch_invariant_mode(models):
    from lockstep.config.base import ConfigError
    from lockstep.generate import Engine, EngineConfig

    with pytest.raises(ConfigError, match=r"engine.batch_invariant: not supported by deepseek_v4 .*"
                                          r"'compressed_attention.eager'"):
        Engine(models[0], None, EngineConfig(cache_memory_mb=4, batch_invariant=True))
