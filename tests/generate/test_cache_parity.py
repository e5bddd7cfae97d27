"""The KV-cache path computes the same next-token logits as a full-sequence forward (cache=None).

Tolerance: max abs <= 1e-4 on logits of scale ~5 (fp32; measured 2e-6 .. 6e-6 on these models,
torch 2.13 CPU). The two paths are the same function with a different float summation order:
SDPA over each sequence's gathered, padded context with a position mask instead of the causal
kernel over the whole sequence; GEMMs over [B, 1] / padded [B, T] batches instead of [1, T]
(different blocking); for MLA, weight absorption ((W_uk^T q) . c instead of q . (W_uk c), and
W_uv applied after the softmax-weighted sum). 1e-4 is the HF parity bound of docs/numerics.md;
a cache bug (a wrong position, block or mask) moves logits by O(1) (checked below).
"""

from __future__ import annotations

import pytest
import torch

from lockstep.generate import Request, SamplingParams
from lockstep.ops import paged_attention

from .conftest import FAMILIES, engine_for, full_forward_logits, prompts, record_logits, tiny_model

TOL = 1e-4


def _greedy(max_new: int, request_id: str | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0)


def _assert_matches_full_forward(model, seen, seq_ids, prompt_list, results) -> float:
    worst = 0.0
    for seq_id, prompt, result in zip(seq_ids, prompt_list, results):
        got = torch.stack(seen[seq_id])
        assert got.shape[0] == len(result.token_ids)
        want = full_forward_logits(model, prompt, result.token_ids)
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"seq {seq_id} (prompt {len(prompt)} tokens): max |logits diff| {diff:.3g}"
        assert result.token_ids == want.argmax(-1).tolist()  # greedy: the full forward picks the same tokens
    return worst


#: decode attention read in place from the pools (C kernel) or gathered + SDPA
PAGED = [pytest.param(True, id="in-place", marks=pytest.mark.skipif(not paged_attention.available(),
                                                                     reason="no C compiler")),
         pytest.param(False, id="gathered")]


@pytest.mark.parametrize("paged", PAGED)
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_and_decode_match_full_forward(family, paged):
    """Prompts of lengths 1..17 in one batch (padded prefill, block size 4: tables of 1..6 blocks)."""
    model = tiny_model(family)
    engine = engine_for(model, block_size=4, max_batch_size=8, paged_attention=paged)
    assert engine.cache.in_place_decode == paged
    seen = record_logits(engine)
    prompt_list = prompts([3, 11, 6, 1, 17])
    budgets = [6, 2, 9, 4, 5]
    results = engine.generate([Request(prompt_ids=p, sampling=_greedy(n)) for p, n in zip(prompt_list, budgets)])
    worst = _assert_matches_full_forward(model, seen, range(5), prompt_list, results)
    print(f"{family}: cache vs full forward, max |logits diff| {worst:.3g}")


@pytest.mark.parametrize("paged", PAGED)
@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_joins_and_leaves_match_full_forward(family, paged):
    """Sequences join between decode steps (into a batch of at most 2) and leave when done; the
    blocks freed by one are reused by the next, so stale cache contents must stay masked."""
    model = tiny_model(family, seed=1)
    engine = engine_for(model, block_size=4, max_batch_size=2, num_blocks=8, paged_attention=paged)
    seen = record_logits(engine)
    prompt_list = prompts([5, 2, 9, 3, 7], seed=1)
    budgets = [3, 8, 2, 6, 4]
    seq_ids = [engine.add_request(Request(prompt_ids=prompt_list[0], sampling=_greedy(budgets[0])))]
    running_sizes = []
    results = {}
    step = 0
    while engine.has_unfinished or len(seq_ids) < len(prompt_list):
        if step in (1, 2, 4, 5) and len(seq_ids) < len(prompt_list):  # joins while others decode
            i = len(seq_ids)
            seq_ids.append(engine.add_request(Request(prompt_ids=prompt_list[i], sampling=_greedy(budgets[i]))))
        for event in engine.step():
            if event.finished:
                results[event.seq_id] = event.result
        running_sizes.append(len(engine.scheduler.running))
        step += 1
    assert max(running_sizes) == 2 and len(results) == 5
    assert engine.cache.allocator.num_free == 8
    worst = _assert_matches_full_forward(model, seen, seq_ids, prompt_list, [results[s] for s in seq_ids])
    print(f"{family}: continuous batching, max |logits diff| {worst:.3g}")


def test_the_tolerance_would_catch_a_context_bug():
    """Changing one early context token moves the last logits by far more than TOL: the
    comparisons above are sensitive to which keys/values a query sees."""
    model = tiny_model("llama3")
    [prompt] = prompts([12])
    other = [prompt[0] % 255 + 1] + prompt[1:]
    with torch.no_grad():
        diff = (model(torch.tensor([prompt]))[0, -1] - model(torch.tensor([other]))[0, -1]).abs().max().item()
    assert diff > 1000 * TOL


def test_mla_cache_stores_the_latent_not_keys_and_values():
    model = tiny_model("deepseek_v3")
    engine = engine_for(model, block_size=4)
    cache = engine.cache
    element = torch.empty((), dtype=torch.float32).element_size()
    for name, block in model.layers.items():
        attn = block.attention
        latent_width = attn.kv_lora_rank + attn.qk_rope_head_dim
        full_kv_width = attn.n_heads * (attn.qk_head_dim + attn.v_head_dim)
        assert latent_width < full_kv_width
        (pool,) = cache.layer(name).pools  # one tensor per layer: the latent
        assert pool.shape == (cache.num_blocks + 1, cache.block_size, latent_width)
        assert pool.element_size() * pool[0, 0].numel() == latent_width * element  # bytes per token, this layer
    per_token = sum(b.attention.kv_lora_rank + b.attention.qk_rope_head_dim for b in model.layers.values()) * element
    assert cache.nbytes == (cache.num_blocks + 1) * cache.block_size * per_token
    from lockstep.generate.cache import PagedKVCache

    assert PagedKVCache.bytes_per_block(cache.layouts, 1, torch.float32) == per_token


def test_mla_latent_in_cache_is_the_normalised_c_kv_and_rotated_k_pe():
    """After prefill, the cached slots hold [kv_norm(c_kv), rope(k_pe)] of every prompt token."""
    model = tiny_model("deepseek_v3")
    engine = engine_for(model, block_size=4)
    [prompt] = prompts([6])
    seq_id = engine.add_request(Request(prompt_ids=prompt, sampling=_greedy(4)))
    engine.step()  # prefill + one decode: 7 tokens cached
    seq = next(s for s in engine.scheduler.running if s.seq_id == seq_id)
    attn = model.layers["0"].attention
    with torch.no_grad():
        x = model.layers["0"].attention_norm(model.tok_embeddings(torch.tensor([prompt])))
        c_kv, k_pe = torch.split(attn.wkv_a(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        from lockstep.models.common.mla import deinterleave
        from lockstep.models.common.rope import apply_rotary

        k_pe = k_pe.unsqueeze(1)
        if attn.config.rope_interleave:
            k_pe = deinterleave(k_pe)
        cos, sin = model.rope(torch.arange(6)[None])
        want = torch.cat([attn.kv_norm(c_kv)[0], apply_rotary(k_pe, cos, sin)[0, 0]], dim=-1)
    (pool,) = engine.cache.layer("0").pools
    slots = torch.cat([pool[b] for b in seq.blocks.tolist()])[:6]
    torch.testing.assert_close(slots, want, rtol=0, atol=1e-6)  # same ops on the same rows; bs-dependent GEMM only


def test_bf16_model_caches_in_bf16_and_runs():
    model = tiny_model("qwen3").to(torch.bfloat16)
    engine = engine_for(model)
    assert all(p.dtype == torch.bfloat16 for name in model.layers for p in engine.cache.layer(name).pools)
    [result] = engine.generate([Request(prompt_ids=prompts([5])[0], sampling=_greedy(4))])
    assert len(result.token_ids) == 4 and all(lp <= 0 for lp in result.logprobs)
