"""The AMX bf16 linear (``lockstep.ops.amx_linear``): what its header promises.

- values: fp32 sums of exact bf16 products, one bf16 rounding: within the error bound below of a
  float64 reference, for row counts across the 16-row tile boundary, column counts across the
  4-block group boundary, both K of SmolLM2, with and without bias;
- a row's bits do not depend on the other rows of the call, where it sits, or the thread count
  (``torch.equal``);
- shapes that do not fit the tiles are refused by ``pack`` with a message naming them, and
  ``supports`` says so beforehand.

Runs only where the CPU has AMX (the kernel does not exist elsewhere; the engine then uses oneDNN).
"""

from __future__ import annotations

import pytest
import torch

from lockstep.ops import amx_linear

pytestmark = pytest.mark.skipif(not amx_linear.available(), reason="no AMX on this CPU (or no C compiler)")


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def _error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    """bf16 products are exact in fp32; K additions (and the bias) in fp32 each err by at most
    2^-24 of the running magnitude, bounded by sum |x_k w_k| (+ |b|); the final bf16 rounding by
    2^-8 of the result (8 significant bits, round to nearest)."""
    k = x.shape[1]
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    return (k + 1) * 2.0**-24 * magnitude * (1 + 2.0**-8) + 2.0**-8 * ref.abs()


@pytest.mark.parametrize("m", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(16, 32), (80, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_within_the_rounding_bound(m, n, k, bias):
    x, w, b = _case(m, n, k, bias)
    got = amx_linear.linear(x, amx_linear.pack(w), n, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    excess = (got.double() - ref).abs() - _error_bound(x, w, b, ref)
    assert excess.max() <= 0, f"worst excess over the bound {excess.max().item():.3g}"


def test_leading_dims_and_empty_input():
    x, w, _ = _case(6, 48, 64, False)
    packed = amx_linear.pack(w)
    flat = amx_linear.linear(x, packed, 48)
    assert torch.equal(amx_linear.linear(x.view(2, 3, 64), packed, 48), flat.view(2, 3, 48))
    assert torch.equal(amx_linear.linear(x.t().contiguous().t(), packed, 48), flat)  # strided input
    assert amx_linear.linear(x[:0], packed, 48).shape == (0, 48)


@pytest.mark.parametrize("n,k", [(80, 576), (960, 576)])
def test_a_row_does_not_depend_on_the_batch_or_threads(n, k):
    x, w, b = _case(40, n, k, True, seed=1)
    packed = amx_linear.pack(w)
    batch = amx_linear.linear(x, packed, n, b)
    for i in (0, 15, 16, 17, 39):  # first/last row of a 16-row tile, and the partial last tile
        assert torch.equal(amx_linear.linear(x[i:i + 1], packed, n, b)[0], batch[i]), i
    assert torch.equal(amx_linear.linear(x.flip(0), packed, n, b), batch.flip(0))
    assert torch.equal(amx_linear.linear(x[9:30], packed, n, b), batch[9:30])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(amx_linear.linear(x, packed, n, b), batch)
    finally:
        torch.set_num_threads(before)


def test_close_to_onednn_but_not_required_bitwise():
    """oneDNN's linear sums in its own order; without bias both stay within the bound of the exact
    result, so they differ by at most twice the bound (a bf16 ulp or so where they differ at all).
    (With a bf16 bias oneDNN rounds the product to bf16 before adding it: two roundings; this
    kernel adds the bias in fp32 and rounds once.)"""
    x, w, _ = _case(16, 960, 576, False, seed=2)
    ours = amx_linear.linear(x, amx_linear.pack(w), 960).double()
    theirs = torch.nn.functional.linear(x, w).double()
    ref = x.double() @ w.double().T
    assert ((ours - theirs).abs() <= 2 * _error_bound(x, w, None, ref)).all()


def test_shapes_outside_the_tiles_are_refused():
    assert amx_linear.supports(64, 576) and not amx_linear.supports(40, 64) and not amx_linear.supports(64, 48)
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 32 == 0, got \(40, 64\)"):
        amx_linear.pack(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        amx_linear.pack(torch.zeros(64, 64))
