"""The decode linears (``lockstep.ops.decode_linear``): what their C headers promise, for the bf16
AMX kernel and the fp32 AVX-512 kernel.

- values: fp32 sums (of exact bf16 products, then one bf16 rounding; or fp32 fused multiply-adds)
  within the error bound below of a float64 reference, for row counts across the kernels' row
  blocks (16 / 12), column counts across their column groups, both K of SmolLM2, with and
  without bias;
- a row's bits do not depend on the other rows of the call, where it sits, or the thread count
  (``torch.equal``);
- shapes that do not fit are refused by ``pack`` with a message naming them, and ``supports`` says
  so beforehand.

Each dtype runs only where its kernel exists (AMX / AVX-512 and a C compiler; the engine otherwise
uses oneDNN / F.linear).
"""

from __future__ import annotations

import pytest
import torch

from lockstep.ops import decode_linear

DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not decode_linear.available(dtype), reason=f"no {name} kernel here"),
                       id=name)
          for dtype, name in ((torch.bfloat16, "bf16-amx"), (torch.float32, "fp32-avx512"))]
AMX = pytest.mark.skipif(not decode_linear.available(torch.bfloat16), reason="no AMX on this CPU (or no C compiler)")


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 12, 13, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(16, 32), (80, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_within_the_rounding_bound(m, n, k, bias, dtype):
    x, w, b = _case(m, n, k, bias, dtype=dtype)
    got = decode_linear.linear(x, decode_linear.pack(w), n, b)
    assert got.dtype == dtype and got.shape == (m, n)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    excess = (got.double() - ref).abs() - _error_bound(x, w, b, ref)
    assert excess.max() <= 0, f"worst excess over the bound {excess.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_empty_input(dtype):
    x, w, _ = _case(6, 48, 64, False, dtype=dtype)
    packed = decode_linear.pack(w)
    flat = decode_linear.linear(x, packed, 48)
    assert torch.equal(decode_linear.linear(x.view(2, 3, 64), packed, 48), flat.view(2, 3, 48))
    assert torch.equal(decode_linear.linear(x.t().contiguous().t(), packed, 48), flat)  # strided input
    assert decode_linear.linear(x[:0], packed, 48).shape == (0, 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(80, 576), (960, 576)])
def test_a_row_does_not_depend_on_the_batch_or_threads(n, k, dtype):
    x, w, b = _case(40, n, k, True, seed=1, dtype=dtype)
    packed = decode_linear.pack(w)
    batch = decode_linear.linear(x, packed, n, b)
    for i in (0, 11, 12, 15, 16, 17, 39):  # first/last rows of row blocks, and the partial last block
        assert torch.equal(decode_linear.linear(x[i:i + 1], packed, n, b)[0], batch[i]), i
    assert torch.equal(decode_linear.linear(x.flip(0), packed, n, b), batch.flip(0))
    assert torch.equal(decode_linear.linear(x[9:30], packed, n, b), batch[9:30])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode_linear.linear(x, packed, n, b), batch)
    finally:
        torch.set_num_threads(before)


@AMX
def test_close_to_onednn_but_not_required_bitwise():
    """oneDNN's linear sums in its own order; without bias both stay within the bound of the exact
    result, so they differ by at most twice the bound (a bf16 ulp or so where they differ at all).
    (With a bf16 bias oneDNN rounds the product to bf16 before adding it: two roundings; this
    kernel adds the bias in fp32 and rounds once.)"""
    x, w, _ = _case(16, 960, 576, False, seed=2)
    ours = decode_linear.linear(x, decode_linear.pack(w), 960).double()
    theirs = torch.nn.functional.linear(x, w).double()
    ref = x.double() @ w.double().T
    assert ((ours - theirs).abs() <= 2 * _error_bound(x, w, None, ref)).all()


def test_shapes_outside_the_tiles_are_refused():
    assert decode_linear.supports(64, 576) and not decode_linear.supports(40, 64) and not decode_linear.supports(64, 48)
    assert decode_linear.supports(64, 48, torch.float32) and not decode_linear.supports(40, 64, torch.float32)
    assert not decode_linear.supports(64, 64, torch.float16)
    with pytest.raises(ValueError, match=r"got \(40, 64\) torch.bfloat16"):
        decode_linear.pack(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got \(64, 64\) torch.float16"):
        decode_linear.pack(torch.zeros(64, 64, dtype=torch.float16))
