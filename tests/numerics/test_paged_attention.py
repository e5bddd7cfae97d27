"""The in-place paged decode attention (``lockstep.ops.paged_attention``) against gather + SDPA.

Both compute in fp32 from the same inputs and round once at the end, in different orders (and the
kernel's exp is a polynomial within 2 ulp of expf), so: fp32 outputs agree to 1e-5 absolute (values
are averages of unit-scale vectors; measured ~1e-6), bf16 outputs to two bf16 ulps at magnitude < 2
(2 * 2^-7 = 0.016; measured one ulp). Covered: grouped heads (1, 3, 4 per kv head), head dims 64
and 128, contexts that end inside, at the end of, and past several blocks, null-block padding in
the tables, and rows at position 0. Both of the kernel's builds run here wherever the CPU runs them:
the AVX-512 path (ISA levels avx512 and amx) and the portable one (forced with ``isa_level``).
The pools are the cache's head-major views (``[Hkv, blocks, block_size, D]`` storage); the kernel
reads any strides in the same order, so other layouts of the same values give identical bits.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.ops import isa, paged_attention
from lockstep.ops.attention import sdpa_cached_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="no C compiler for the kernel")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-7}
#: the kernel's distinct builds this machine runs
PATHS = [level for level in ("avx512", "portable") if level in isa.runnable()]
#: storage orders of the logical [blocks, block_size, Hkv, D] pools: the cache's head-major one, token-major
#: (the layout before it) and head-major within each block
LAYOUTS = {"head": (2, 0, 1, 3), "token": (0, 1, 2, 3), "block-head": (0, 2, 1, 3)}


def _stored(pool, layout):
    order = LAYOUTS[layout]
    return pool.permute(order).contiguous().permute([order.index(i) for i in range(4)])


def _case(batch, heads, kv_heads, d, block_size, width, dtype, seed=0, layout="head"):
    gen = torch.Generator().manual_seed(seed)
    blocks = batch * width + 1
    k_pool = _stored(torch.randn(blocks, block_size, kv_heads, d, generator=gen).to(dtype), layout)
    v_pool = _stored(torch.randn(blocks, block_size, kv_heads, d, generator=gen).to(dtype), layout)
    q = torch.randn(batch, heads, 1, d, generator=gen).to(dtype)
    tables = torch.randperm(blocks - 1, generator=gen)[: batch * width].view(batch, width) + 1
    positions = torch.randint(0, width * block_size, (batch, 1), generator=gen)
    positions[0] = 0
    positions[-1] = width * block_size - 1  # the whole table
    if batch > 2:  # a short sequence: the rest of its table is the null block
        positions[1] = block_size // 2
        tables[1, 1:] = 0
    return q, k_pool, v_pool, tables, positions


def _gathered(q, k_pool, v_pool, tables, positions, scale):
    b, width = tables.shape
    k = k_pool.index_select(0, tables.reshape(-1)).view(b, width * k_pool.shape[1], *k_pool.shape[2:]).transpose(1, 2)
    v = v_pool.index_select(0, tables.reshape(-1)).view(b, width * v_pool.shape[1], *v_pool.shape[2:]).transpose(1, 2)
    return sdpa_cached_attention(q, k, v, q_positions=positions, scale=scale)


@pytest.mark.parametrize("isa_level", PATHS, indirect=True)
@pytest.mark.parametrize("batch", [2, 5])  # tasks of one kv head / of every kv head of a sequence
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 3, 32), (40, 2, 16)])
def test_matches_gather_and_sdpa(batch, dtype, heads, kv_heads, d, isa_level):
    q, k_pool, v_pool, tables, positions = _case(batch, heads, kv_heads, d, block_size=4, width=6, dtype=dtype)
    assert paged_attention.usable(q, k_pool, v_pool)
    scale = d**-0.5
    got = torch.ops.lockstep.paged_decode_attention(q, k_pool, v_pool, tables, positions, scale)
    want = _gathered(q, k_pool, v_pool, tables, positions, scale)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("isa_level", PATHS, indirect=True)
def test_position_zero_returns_the_first_value_row(isa_level):
    q, k_pool, v_pool, tables, positions = _case(3, 4, 2, 64, block_size=4, width=3, dtype=torch.float32, seed=1)
    got = torch.ops.lockstep.paged_decode_attention(q, k_pool, v_pool, tables, positions, 0.125)
    first = v_pool[tables[0, 0], 0]  # [kv_heads, d]: one key, softmax weight exactly 1
    assert torch.equal(got[0, :, 0], first.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("isa_level", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_pool_layout_gives_the_same_bits(dtype, isa_level):
    """Strides change where rows are read, not the arithmetic: token-major, head-major and head-major
    within blocks give identical outputs (batch 2 and 5: a task per kv head / per sequence)."""
    for batch in (2, 5):
        outs = []
        for layout in LAYOUTS:
            q, k_pool, v_pool, tables, positions = _case(batch, 9, 3, 64, 4, 6, dtype, seed=4, layout=layout)
            assert paged_attention.usable(q, k_pool, v_pool)
            outs.append(torch.ops.lockstep.paged_decode_attention(q, k_pool, v_pool, tables, positions, 0.125))
        assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_unusable_shapes_are_declined():
    q, k_pool, v_pool, *_ = _case(2, 4, 2, 64, block_size=4, width=2, dtype=torch.float32)
    assert not paged_attention.usable(q, k_pool, v_pool.contiguous())  # K and V strides differ
    assert not paged_attention.usable(q, k_pool[..., ::2], v_pool[..., ::2])  # head dim not contiguous
    assert not paged_attention.usable(q.expand(2, 4, 3, 64), k_pool, v_pool)  # prefill: T > 1
    assert not paged_attention.usable(q.to(torch.bfloat16), k_pool, v_pool)  # dtype mismatch
    assert not paged_attention.usable(q[..., :40], k_pool[..., :40], v_pool[..., :40])  # d % 16
    assert not paged_attention.usable(q.requires_grad_(), k_pool, v_pool)


@pytest.mark.parametrize("isa_level", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 64), (9, 3, 16), (40, 2, 16)])
@pytest.mark.parametrize("sink,window", [(True, 0), (False, 5), (True, 5), (True, 1), (True, 30)])
def test_sinks_and_windows_match_gather_and_sdpa(dtype, heads, kv_heads, d, sink, window, isa_level):
    """GPT-OSS: sink logits in the denominator and a window (5 and 1 divide no block of 4; 30 spans the
    whole table); blocks before a row's window are replaced by the null block, as never read."""
    q, k_pool, v_pool, tables, positions = _case(5, heads, kv_heads, d, block_size=4, width=6, dtype=dtype, seed=2)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2 if sink else None
    if window:
        first_block = (positions[:, 0] + 1 - window).clamp(min=0) // 4
        tables = torch.where(torch.arange(6)[None] < first_block[:, None], 0, tables)
    got = torch.ops.lockstep.paged_decode_attention(q, k_pool, v_pool, tables, positions, d**-0.5, sinks, window)
    b, width = tables.shape
    k = k_pool.index_select(0, tables.reshape(-1)).view(b, width * 4, kv_heads, d).transpose(1, 2)
    v = v_pool.index_select(0, tables.reshape(-1)).view(b, width * 4, kv_heads, d).transpose(1, 2)
    want = sdpa_cached_attention(q.float(), k.float(), v.float(), q_positions=positions, scale=d**-0.5,
                                 sinks=sinks, window=window).to(dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[dtype])
