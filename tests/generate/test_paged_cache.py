"""Paged KV cache bookkeeping: sizing from the memory budget, block tables, freeing, refusal."""

from __future__ import annotations

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.generate import EngineConfig, Request, SamplingParams
from lockstep.generate.cache import NULL_BLOCK, BlockAllocator, PagedKVCache
from lockstep.generate.prefill import prefill

from .conftest import engine_for, prompts, tiny_model


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def test_num_blocks_follow_the_memory_budget():
    model = tiny_model("llama3")  # 2 layers, 2 KV heads of 16: 2 * 2 * 2 * 16 fp32 values per token
    per_token = 2 * (2 * 2 * 16) * 4
    engine = engine_for(model, cache_memory_mb=1, block_size=8)
    assert engine.cache.num_blocks == (1 << 20) // (per_token * 8)
    assert PagedKVCache.bytes_per_block(engine.cache.layouts, 8, torch.float32) == per_token * 8
    # the pools really take that much (plus the one null block)
    assert engine.cache.nbytes == (engine.cache.num_blocks + 1) * 8 * per_token
    assert engine_for(model, num_blocks=5).cache.num_blocks == 5  # explicit count wins


def test_allocator_hands_out_distinct_blocks_and_takes_them_back():
    alloc = BlockAllocator(6)
    a, b = alloc.allocate(2), alloc.allocate(3)
    assert len(set(a + b)) == 5 and NULL_BLOCK not in a + b and alloc.num_free == 1
    with pytest.raises(RuntimeError, match="3 blocks requested, 1 free"):
        alloc.allocate(3)
    alloc.free(a)
    assert alloc.num_free == 3
    alloc.free(b)
    assert alloc.num_free == 6 and sorted(alloc.allocate(6)) == [1, 2, 3, 4, 5, 6]


def test_block_tables_and_slots_follow_positions():
    """A sequence reserves ceil((prompt + max_new - 1) / block_size) blocks; token p lives at
    table[p // bs] * bs + p % bs, and those slots hold its keys after prefill."""
    model = tiny_model("llama3")
    engine = engine_for(model, block_size=4, num_blocks=16)
    p1, p2 = prompts([6, 3])
    s1 = engine.add_request(Request(prompt_ids=p1, sampling=_greedy(5)))   # 10 tokens cached at most: 3 blocks
    s2 = engine.add_request(Request(prompt_ids=p2, sampling=_greedy(2)))   # 4: 1 block
    admitted = engine.scheduler.admit()
    assert [s.seq_id for s in admitted] == [s1, s2]
    assert [len(s.blocks) for s in admitted] == [3, 1]
    assert engine.cache.allocator.num_free == 12
    assert not set(admitted[0].blocks.tolist()) & set(admitted[1].blocks.tolist())
    tables = engine._block_tables(admitted, 2)
    assert tables[0].tolist() == admitted[0].blocks[:2].tolist()
    assert tables[1].tolist() == [admitted[1].blocks[0].item(), NULL_BLOCK]  # padded with the null block
    prefill(engine, admitted)
    k_pool = engine.cache.layer("0").pools[0]
    attn = model.layers["0"].attention
    # stored head-major under the [blocks, block_size, Hkv, D] view: one kv head's rows of consecutive blocks are one run
    assert k_pool.shape == (17, 4, attn.n_kv_heads, attn.head_dim) and k_pool.permute(2, 0, 1, 3).is_contiguous()
    with torch.no_grad():
        x = model.layers["0"].attention_norm(model.tok_embeddings(torch.tensor([p1])))
        k = attn.wk(x).view(1, 6, -1, attn.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        from lockstep.models.common.rope import apply_rotary

        cos, sin = model.rope(torch.arange(6)[None])
        k = apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2)[0]  # [6, Hkv, D]
    blocks = admitted[0].blocks.tolist()
    for pos in range(6):
        slot = k_pool[blocks[pos // 4], pos % 4]
        torch.testing.assert_close(slot, k[pos], rtol=0, atol=1e-6)


def test_blocks_are_freed_when_sequences_finish_and_when_aborted():
    model = tiny_model("qwen3")
    engine = engine_for(model, block_size=4, num_blocks=12)
    free_counts = []
    ids = [engine.add_request(Request(prompt_ids=p, sampling=_greedy(n)))
           for p, n in zip(prompts([5, 2, 7]), [2, 6, 3])]
    while engine.has_unfinished:
        engine.step()
        free_counts.append(engine.cache.allocator.num_free)
    # reserved: 2 + 2 + 3 blocks (worst cases of 6, 7, 9 tokens); the first finishes in step 1
    # (prefill token + one decode), the third in step 2, the second (6 new tokens) in step 5
    assert free_counts == [12 - 7 + 2, 12 - 2, 12 - 2, 12 - 2, 12]
    # abort: a running and a waiting one
    engine = engine_for(model, block_size=4, num_blocks=4, max_batch_size=1)
    a = engine.add_request(Request(prompt_ids=prompts([5])[0], sampling=_greedy(8)))
    b = engine.add_request(Request(prompt_ids=prompts([3])[0], sampling=_greedy(8)))
    engine.step()
    assert engine.cache.allocator.num_free == 1
    partial = engine.abort(a)
    assert partial.finish_reason == "abort" and len(partial.token_ids) == 2  # prefill token + one decode
    assert engine.cache.allocator.num_free == 4
    assert engine.abort(b).finish_reason == "abort" and engine.abort(b) is None
    assert not engine.has_unfinished and engine.cache.allocator.num_free == 4
    assert ids == [0, 1, 2]


def test_waiting_requests_are_admitted_when_blocks_come_back():
    """Two requests that each need 3 of 4 blocks run one after the other, never together."""
    model = tiny_model("llama3")
    engine = engine_for(model, block_size=4, num_blocks=4, max_batch_size=8)
    reqs = [Request(prompt_ids=p, sampling=_greedy(4)) for p in prompts([8, 8])]
    for r in reqs:
        engine.add_request(r)
    together = 0
    while engine.has_unfinished:
        engine.step()
        together = max(together, len(engine.scheduler.running))
    assert together == 1 and engine.cache.allocator.num_free == 4


def test_prompt_longer_than_the_cache_is_refused():
    model = tiny_model("llama3")
    engine = engine_for(model, block_size=4, num_blocks=3)  # 12 tokens
    with pytest.raises(ConfigError, match=r"Request\.prompt_ids: the prompt has 13 tokens, longer than the KV "
                                          r"cache budget of 12 tokens .*cache_memory_mb"):
        engine.add_request(Request(prompt_ids=[1] * 13))
    # a prompt that fills the cache exactly still gets one token ("length": the cache capped it)
    [result] = engine.generate([Request(prompt_ids=[1] * 12, sampling=_greedy(5))])
    assert len(result.token_ids) == 1 and result.finish_reason == "length"
    assert engine.cache.allocator.num_free == 3


def test_a_budget_holding_no_block_is_refused():
    with pytest.raises(ConfigError, match="engine.cache_memory_mb"):
        engine_for(tiny_model("llama3"), cache_memory_mb=1e-4)
    with pytest.raises(ConfigError, match="engine.cache_memory_mb"):
        EngineConfig(cache_memory_mb=0).validate()
