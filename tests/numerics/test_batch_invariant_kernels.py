"""The batch-invariant kernels, one by one: bitwise invariance where promised, accuracy elsewhere.

The C kernels run at every :mod:`lockstep.ops.isa` level this machine runs (forced in-process): the
fp32 linear and attention have an AVX-512 and a portable build, the bf16 linear an AMX, a vdpbf16ps
and a plain C path; the tiled fallback is what runs without a compiler.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.ops import bi_kernel, decode_linear, isa
from lockstep.ops.attention import reference_attention
from lockstep.ops.batch_invariant import KV_CHUNK, chunked_attention, head_matmul, linear

DTYPES = [torch.float32, torch.bfloat16]
#: "c-<level>": the C kernels (lockstep.ops.bi_kernel, decode_linear) at each ISA level this machine
#: runs; "tiled": the fixed-tile bmm fallback used without a compiler
IMPLS = [f"c-{level}" for level in isa.runnable()] + ["tiled"]


@pytest.fixture
def impl(request, monkeypatch):
    if request.param == "tiled":
        monkeypatch.setattr(bi_kernel, "available", lambda: False)
        monkeypatch.setattr(decode_linear, "available", lambda dtype=None: False)
        yield request.param
        return
    with isa.forced(request.param.removeprefix("c-")):
        yield request.param


def test_the_c_kernels_build_where_there_is_a_compiler():
    if shutil.which("gcc") or shutil.which("cc"):
        for level in isa.runnable():
            with isa.forced(level):
                assert bi_kernel.available() and decode_linear.available(torch.bfloat16), level


@pytest.mark.skipif("avx512" not in isa.runnable(), reason="one build only: no AVX-512 here")
def test_the_avx512_and_portable_builds_give_the_same_bits():
    """bi_linear.c's two paths (fmaf is one IEEE operation) and bi_attention.c (the source order is
    the arithmetic order in both builds)."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(37, 37, generator=g), torch.randn(50, 37, generator=g)
    q, k, v = (torch.randn(2, h, 45, 16, generator=g) for h in (4, 2, 2))
    outs = []
    for level in ("avx512", "portable"):
        with isa.forced(level):
            outs.append((linear(x, w), linear(x[:, :32], w[:, :32]), chunked_attention(q, k, v, torch.arange(45).expand(2, 45))))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.integers(0, 99), min_size=1, max_size=70), width=st.sampled_from([192, 37]))
def test_linear_row_does_not_depend_on_the_batch(impl, dtype, rows, width):
    """``width`` 37: the C kernel's tail lanes (K not a multiple of 16) and a ragged last weight block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, width, generator=g).to(dtype)
    w = torch.randn(322, width, generator=g).to(dtype)
    reference = linear(x, w)
    assert torch.equal(linear(x[rows], w), reference[rows])


def test_plain_matmul_is_not_batch_invariant_here():
    """Why the tiled kernel exists: on this CPU a lone row (GEMV path) differs from the same row in a batch."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g), torch.randn(1536, 576, generator=g)
    full = torch.nn.functional.linear(x, w)
    assert any(not torch.equal(torch.nn.functional.linear(x[i:i + m], w), full[i:i + m])
               for i, m in ((0, 1), (3, 2), (5, 7)))


def test_linear_follows_in_place_weight_updates():
    """No stale per-weight state: an in-place update (an optimizer step, a weight sync) is seen at once."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 40, generator=g), torch.nn.Parameter(torch.randn(24, 40, generator=g))
    with torch.no_grad():
        before = linear(x, w)
        w.mul_(-2.0)
        torch.testing.assert_close(linear(x, w), -2.0 * before, rtol=0, atol=1e-5)
        w.copy_(torch.randn(24, 40, generator=g))
        torch.testing.assert_close(linear(x, w), x @ w.t(), rtol=0, atol=1e-5)


def test_linear_matches_f_linear_and_its_gradients():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True)
    ours = linear(x, w, b)
    theirs = torch.nn.functional.linear(x, w, b)
    # fp32 sums of 64 products in another order: a few ulps of outputs up to ~30 (ulp 2e-6 there)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)
    grads = torch.autograd.grad(ours.square().sum(), (x, w, b))
    expected = torch.autograd.grad(theirs.square().sum(), (x, w, b))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w, b).dtype == torch.bfloat16


def test_head_matmul_is_per_row_invariant_and_right():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 4, 45, 16, generator=g), torch.randn(4, 16, 24, generator=g)
    out = head_matmul(x, w)
    torch.testing.assert_close(out, torch.einsum("bhtn,hnr->bhtr", x, w), rtol=0, atol=1e-5)
    assert torch.equal(head_matmul(x[1:2, :, 7:9], w), out[1:2, :, 7:9])


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_decode_from_a_cache_equals_the_full_sequence(impl, dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(3)
    b, t, d = 3, 2 * KV_CHUNK + 13, 16
    q = torch.randn(b, heads, t, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, t, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, t, d, generator=g).to(dtype)
    full = chunked_attention(q, k, v, torch.arange(t).expand(b, t))
    # accuracy against plain fp32 softmax attention: fp32 sums in another order
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 output rounding (8 bits of mantissa)
    torch.testing.assert_close(full.float(), reference_attention(q, k, v, causal=True).float(), rtol=0, atol=tol)
    for pos in (0, 1, KV_CHUNK - 1, KV_CHUNK, KV_CHUNK + 1, t - 1):
        # a decode batch of sequences 2 and 0, context padded past pos with other finite values
        ctx = pos + 1 + 2 * KV_CHUNK
        kc, vc = torch.randn(2, kv_heads, ctx, d, generator=g).to(dtype), torch.randn(2, kv_heads, ctx, d, generator=g).to(dtype)
        kc[:, :, : pos + 1], vc[:, :, : pos + 1] = k[[2, 0], :, : pos + 1], v[[2, 0], :, : pos + 1]
        step = chunked_attention(q[[2, 0], :, pos:pos + 1], kc, vc, torch.full((2, 1), pos))
        assert torch.equal(step, full[[2, 0], :, pos:pos + 1]), pos



@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 39), min_size=1, max_size=13))
def test_rowwise_transcendentals_do_not_depend_on_the_row_position(rows):
    """Router scores are [tokens, 8]: without padding, rows in the scalar tail of the kernel differ."""
    from lockstep import numerics

    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(4)) * 4
    with numerics.batch_invariant():
        reference = numerics.rowwise(torch.sigmoid, x)
        assert torch.equal(numerics.rowwise(torch.sigmoid, x[rows]), reference[rows])
    torch.testing.assert_close(reference, torch.sigmoid(x), rtol=0, atol=1e-6)  # 1-ulp-level: same function


@pytest.mark.parametrize("square", [True, False])
def test_attention_gradients_are_the_ordinary_ones(square):
    """The backward recomputes plain SDPA (flash for the trainer's square causal case, masked otherwise)."""
    from lockstep.ops.batch_invariant import _full_attention

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 40, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 40, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 40, 16, generator=g, requires_grad=True)
    out = _full_attention(q, k, v) if square else chunked_attention(q, k, v, torch.arange(40).expand(2, 40))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference_attention(q, k, v, causal=True).square().sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # fp32, another summation order


@pytest.mark.slow
@pytest.mark.parametrize("level", [level for level in isa.runnable() if level != isa.detected()])
def test_models_trainer_equals_generator_at_lower_levels(level):
    """The whole-model promise (test_batch_invariant_models.py) at each lower ISA level, in a
    subprocess: ``LOCKSTEP_CPU_ISA`` caps lockstep's kernels and, below amx, ``ONEDNN_MAX_CPU_ISA``
    caps oneDNN's before torch loads, so torch's own bf16 GEMMs run their non-AMX kernels too (as on
    a CPU without AMX). bf16, every family (the bf16 linear is what differs between levels)."""
    env = {**os.environ, isa.ENV: level}
    if isa.detected() == "amx":
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    models = os.path.join(os.path.dirname(__file__), "test_batch_invariant_models.py")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", models,
                             "-k", "generator_logprobs_equal_trainer and bfloat16"],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
