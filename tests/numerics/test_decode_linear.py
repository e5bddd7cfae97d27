"""The C linears (``lockstep.ops.decode_linear``): what their C headers promise, for every kernel this
machine runs: bf16 on AMX tiles, bf16 AVX-512 (``vdpbf16ps``'s arithmetic as fp32 FMAs), bf16 plain C, and
fp32 AVX-512.

Each kernel is reached by forcing its :mod:`lockstep.ops.isa` level (``isa_level``, tests/conftest.py):
bf16 at every level this CPU runs (amx, avx512, portable), fp32 at avx512 (its only build). A level
the CPU lacks is not collected; the lower ones are.

- values: fp32 sums (of exact bf16 products, then one bf16 rounding; or fp32 fused multiply-adds)
  within the error bound below of a float64 reference, for row counts across the kernels' row
  blocks (AMX 16, fp32 12, bf16 AVX-512 8, plain C 6) and 48-row items, column counts across their
  column groups, both K of SmolLM2 and one that ends in a partial k chunk, with and without bias;
  bf16 also at shapes off the AMX tiles (padded pack);
- a row's bits do not depend on the other rows of the call, where it sits (row blocks, 48-row
  items), or the thread count (``torch.equal``);
- the AVX-512 bf16 path (fp32 FMAs under MXCSR DAZ/FTZ, vdpbf16ps's arithmetic) and the plain C
  path give the same bits (the C header's claim), denormal inputs and biases included;
- the caller's floating-point mode is left as it was (denormals still computed after a call, in
  the calling thread and in torch's other threads);
- shapes that do not fit are refused by ``pack`` with a message naming them.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lockstep.ops import decode_linear, isa

#: (dtype, level): every kernel build this machine runs
KERNELS = [pytest.param((torch.bfloat16, level), id=f"bf16-{level}") for level in isa.runnable()]
KERNELS += [pytest.param((torch.float32, "avx512"), id="fp32-avx512")] if "avx512" in isa.runnable() else []
#: which kernel a whole-tile bf16 weight runs at each level
EXPECTED = {"amx": "amx", "avx512": "avx512_bf16" if "avx512_bf16" in isa.cpu_flags() else "portable_bf16",
            "portable": "portable_bf16"}


@pytest.fixture
def kernel(request):
    dtype, level = request.param
    with isa.forced(level):
        assert decode_linear.available(dtype)
        if dtype == torch.bfloat16:
            assert decode_linear.kernel(dtype, 960, 576) == EXPECTED[level]
        yield dtype


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def _error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    """Products are exact in fp32 (bf16 pairs) or fused into the addition (fp32 FMA); K additions
    (and the bias) in fp32 each err by at most 2^-24 of the running magnitude, bounded by
    sum |x_k w_k| (+ |b|); a bf16 result's final rounding by 2^-8 of it (8 significant bits,
    round to nearest)."""
    k = x.shape[1]
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    final = 2.0**-8 if x.dtype == torch.bfloat16 else 0.0
    return (k + 1) * 2.0**-24 * magnitude * (1 + final) + final * ref.abs()


@functools.cache
def _reference(m: int, n: int, k: int, bias: bool, dtype: torch.dtype):
    """A case, its float64 result and its error bound (shared by every kernel's test)."""
    x, w, b = _case(m, n, k, bias, dtype=dtype)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    return x, w, b, ref, _error_bound(x, w, b, ref)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("m", [1, 7, 13, 17, 40])  # row blocks: 6 (bf16 C), 8 (bf16 AVX-512), 12 (fp32), 16 (AMX)
@pytest.mark.parametrize("n,k", [(16, 32), (48, 100), (80, 576), (960, 576), (576, 1536)])  # 100: k chunks 64 + 36
@pytest.mark.parametrize("bias", [False, True])
def test_values_within_the_rounding_bound(m, n, k, bias, kernel):
    x, w, b, ref, bound = _reference(m, n, k, bias, kernel)
    got = decode_linear.linear(x, decode_linear.pack(w), n, b)
    assert got.dtype == kernel and got.shape == (m, n)
    excess = (got.double() - ref).abs() - bound
    assert excess.max() <= 0, f"worst excess over the bound {excess.max().item():.3g}"


@pytest.mark.parametrize("isa_level", isa.runnable(), indirect=True)
@pytest.mark.parametrize("n,k", [(40, 37), (17, 1), (322, 192), (8, 64), (48, 101)])  # 101: 51 pairs, 2 chunks
def test_bf16_shapes_off_the_tiles(n, k, isa_level):
    """Any N and K: the pack pads with zeros, the kernel masks the last columns and reads x only to K."""
    x, w, b = _case(9, n, k, True, seed=3)
    got = decode_linear.linear(x, decode_linear.pack(w), n, b)
    ref = x.double() @ w.double().T + b.double()
    assert ((got.double() - ref).abs() <= _error_bound(x, w, b, ref)).all()
    assert torch.equal(decode_linear.linear(x[4:5], decode_linear.pack(w), n, b)[0], got[4])


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_leading_dims_and_empty_input(kernel):
    x, w, _ = _case(6, 48, 64, False, dtype=kernel)
    packed = decode_linear.pack(w)
    flat = decode_linear.linear(x, packed, 48)
    assert torch.equal(decode_linear.linear(x.view(2, 3, 64), packed, 48), flat.view(2, 3, 48))
    assert torch.equal(decode_linear.linear(x.t().contiguous().t(), packed, 48), flat)  # strided input
    assert decode_linear.linear(x[:0], packed, 48).shape == (0, 48)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("n,k", [(80, 576), (960, 576)])
def test_a_row_does_not_depend_on_the_batch_or_threads(n, k, kernel):
    x, w, b = _case(50, n, k, True, seed=1, dtype=kernel)
    packed = decode_linear.pack(w)
    batch = decode_linear.linear(x, packed, n, b)
    # first/last rows of row blocks (6, 8, 12, 16) and of 48-row items, and the partial last ones
    for i in (0, 5, 6, 7, 8, 11, 12, 15, 16, 17, 23, 24, 39, 47, 48, 49):
        assert torch.equal(decode_linear.linear(x[i:i + 1], packed, n, b)[0], batch[i]), i
    assert torch.equal(decode_linear.linear(x.flip(0), packed, n, b), batch.flip(0))
    assert torch.equal(decode_linear.linear(x[9:30], packed, n, b), batch[9:30])
    assert torch.equal(decode_linear.linear(x[:16], packed, n, b), batch[:16])  # a decode step's batch
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode_linear.linear(x, packed, n, b), batch)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif("avx512" not in isa.runnable() or "avx512_bf16" not in isa.cpu_flags(),
                    reason="the AVX-512 bf16 path needs a CPU with avx512_bf16: there is only the plain C path to test")
def test_the_avx512_path_and_plain_c_give_the_same_bits():
    """bf16_linear.c's two paths: the same operations (fma pairs, DAZ/FTZ), so the same bits, on
    random shapes and on denormal inputs, products and biases (flushed alike)."""
    cases = [_case(m, n, k, bias, seed=m + n) for m, n, k, bias in ((1, 576, 576, False), (13, 40, 37, True),
                                                                     (50, 322, 192, True), (7, 960, 1536, False))]
    tiny = torch.tensor([1e-39, 1.0, -2.0, 3e-39, 1e-20, 1.3e-19, -5e-21, 0.5] * 8)
    w_tiny = (tiny.flip(0)[None] * tiny[:16, None]).to(torch.bfloat16)
    cases.append((tiny[None].to(torch.bfloat16), w_tiny, None))
    # denormal biases (added as they are, then read as 0 by the rounding) beside sums near the smallest normal
    x_small = torch.tensor([[2.0**-63, 0.0] * 32, [2.0**-63, 2.0**-70] * 32]).to(torch.bfloat16)
    w_small = torch.zeros(16, 64).index_fill_(1, torch.tensor([0]), 2.0**-63).to(torch.bfloat16)
    b_small = torch.tensor([1e-39, -1e-39, 2.0**-127, -(2.0**-127), 1e-45, 0.0, 2.0**-126, -(2.0**-126)] * 2)
    cases += [(x_small, w_small, b_small), (tiny[None].to(torch.bfloat16), w_tiny, b_small * 1e30)]
    for x, w, b in cases:
        outs = []
        for level in ("avx512", "portable"):
            with isa.forced(level):
                outs.append(decode_linear.linear(x, decode_linear.pack(w), w.shape[0], b))
        assert torch.equal(*outs), tuple(w.shape)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_the_callers_floating_point_mode_is_kept(kernel):
    """The bf16 AVX-512 path sets MXCSR's DAZ and FTZ in every thread that runs it and restores them:
    denormals are still produced and read afterwards, in this thread and in torch's other threads."""
    x, w, b = _case(17, 960, 64, True, dtype=kernel)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        decode_linear.linear(x, decode_linear.pack(w), 960, b)
        small = torch.full((1 << 16,), 2.0**-126)
        assert (small / 8 > 0).all() and ((small / 8) * 8 == small).all()  # a denormal made, then read
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa_level", isa.runnable(), indirect=True)
def test_close_to_onednn_but_not_required_bitwise(isa_level):
    """oneDNN's linear sums in its own order; without bias both stay within the bound of the exact
    result, so they differ by at most twice the bound (a bf16 ulp or so where they differ at all).
    (With a bf16 bias oneDNN rounds the product to bf16 before adding it: two roundings; these
    kernels add the bias in fp32 and round once.)"""
    x, w, _ = _case(16, 960, 576, False, seed=2)
    ours = decode_linear.linear(x, decode_linear.pack(w), 960).double()
    theirs = torch.nn.functional.linear(x, w).double()
    ref = x.double() @ w.double().T
    assert ((ours - theirs).abs() <= 2 * _error_bound(x, w, None, ref)).all()


def test_shapes_outside_the_layouts_are_refused():
    assert decode_linear.supports(64, 576) and decode_linear.supports(40, 37) and not decode_linear.supports(0, 64)
    assert decode_linear.amx_fits(64, 576) and not decode_linear.amx_fits(40, 64) and not decode_linear.amx_fits(64, 48)
    assert decode_linear.supports(64, 48, torch.float32) and not decode_linear.supports(40, 64, torch.float32)
    assert not decode_linear.supports(64, 64, torch.float16)
    with pytest.raises(ValueError, match=r"got \(40, 64\) torch.float32"):
        decode_linear.pack(torch.zeros(40, 64))
    with pytest.raises(ValueError, match=r"got \(64, 64\) torch.float16"):
        decode_linear.pack(torch.zeros(64, 64, dtype=torch.float16))
