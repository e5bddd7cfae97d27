"""The chunked gated delta rule computes the recurrence: outputs and final state, chunk sizes that do
and do not divide the length, a carried initial state, and gradients (gradcheck in fp64)."""

import pytest
import torch

from lockstep.models.common.delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_step,
    invariant_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

# fp32: the chunked form sums in another order (UT solve, chunk matmuls); measured max |diff| is
# ~1e-6 on these O(1) outputs, so 1e-4 leaves margin while catching any real mistake (a wrong
# decay or a dropped correction term shows up at >= 1e-2).
ATOL = 1e-4


def inputs(b=2, t=19, h=3, dk=8, dv=6, dtype=torch.float32, seed=0, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype))
    k = l2_normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype))
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    scale = 4.0 if strong_decay else 0.5
    g = -scale * torch.rand(b, t, h, generator=gen, dtype=dtype)
    beta = torch.rand(b, t, h, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 16, 19, 64])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_equals_recurrence(chunk_size, strong_decay):
    q, k, v, g, beta = inputs(strong_decay=strong_decay)  # t=19: 4, 5, 16, 64 do not divide it
    ref, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)
    assert out.shape == ref.shape == (2, 19, 3, 6) and state.shape == (2, 3, 8, 6)
    diff = (out - ref).abs().max().item()
    print(f"chunk={chunk_size} strong_decay={strong_decay}: max |out diff| {diff:.2e}")
    assert diff <= ATOL
    torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=0)


def test_initial_state_carries_across_calls():
    """Two halves with the state handed over == the whole sequence (what prefill then decode does)."""
    q, k, v, g, beta = inputs(t=23)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    first, mid = chunk_gated_delta_rule(*(x[:, :10] for x in (q, k, v, g, beta)), chunk_size=8)
    second, end = chunk_gated_delta_rule(*(x[:, 10:] for x in (q, k, v, g, beta)), chunk_size=8, initial_state=mid)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(end, whole_state, atol=ATOL, rtol=0)
    # and the single-token step continues a chunked prefix exactly like the recurrence
    state = mid
    for i in range(10, 23):
        o, state = gated_delta_step(q[:, i] * 8 ** -0.5, k[:, i], v[:, i], g[:, i], beta[:, i], state)
        torch.testing.assert_close(o, whole[:, i], atol=ATOL, rtol=0)


def test_decay_and_beta_matter():
    """Guards against a test that passes on an identity: zero beta writes nothing, so output is 0."""
    q, k, v, g, beta = inputs()
    out, state = chunk_gated_delta_rule(q, k, v, g, torch.zeros_like(beta), chunk_size=4)
    assert out.abs().max() == 0 and state.abs().max() == 0
    a, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
    b, _ = chunk_gated_delta_rule(q, k, v, g * 2, beta, chunk_size=4)
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("chunk_size", [3, 4])
def test_gradcheck_fp64(chunk_size):
    q, k, v, g, beta = (x.requires_grad_() for x in inputs(b=1, t=7, h=2, dk=3, dv=2, dtype=torch.float64))
    s0 = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, g, beta, s0):
        out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=s0)
        return out, state

    assert torch.autograd.gradcheck(fn, (q, k, v, g, beta, s0), eps=1e-6, atol=1e-6)


def test_gradients_of_chunked_match_recurrence():
    q, k, v, g, beta = inputs(t=13)
    grads = []
    for run in (lambda *a: recurrent_gated_delta_rule(*a), lambda *a: chunk_gated_delta_rule(*a, chunk_size=4)):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        out, state = run(*xs)
        (out.square().sum() + state.sum()).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_batch_invariant_form_computes_the_recurrence():
    """The batch-invariant recurrence (state kept transposed, last-dim sums) is the same function."""
    q, k, v, g, beta = inputs(t=23)
    s0 = torch.randn(2, 3, 8, 6)
    ref, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    out, state = invariant_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=0)
