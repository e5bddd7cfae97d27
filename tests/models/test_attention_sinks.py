"""Attention sinks and sliding windows in the attention backends (GPT-OSS; lockstep.ops.attention):
every backend against an independent eager computation (transformers' GPT-OSS formula), full and
KV-cache variants, gradients, and the batch-invariant backend's trainer == generator bits."""

import pytest
import torch

from lockstep.ops.attention import attention_backend, get_attention, get_cached_attention

# fp32 everywhere; the kernels differ only in summation order (~1e-7 on O(1) outputs)
ATOL = 1e-5
B, H, HKV, D = 2, 6, 2, 16


def eager(q, k, v, sinks, window, q_pos):
    """transformers' eager_attention_forward of GPT-OSS, written out: scores, the window/causal mask
    by position, the sink column, max subtracted, softmax, sink dropped."""
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    scores = q @ k.transpose(-1, -2) / D ** 0.5
    keys = torch.arange(k.shape[2])
    allowed = keys[None, None, None, :] <= q_pos[:, None, :, None]
    if window:
        allowed &= keys[None, None, None, :] > q_pos[:, None, :, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = scores.softmax(-1)
    return (probs[..., :-1] if sinks is not None else probs) @ v


def tensors(t, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t, D, generator=g)
    k, v = torch.randn(B, HKV, s, D, generator=g), torch.randn(B, HKV, s, D, generator=g)
    return q, k, v, torch.randn(H, generator=g) * 2


CASES = [(None, 0), ("sinks", 0), (None, 5), ("sinks", 5), ("sinks", 1), ("sinks", 40)]


@pytest.mark.parametrize("backend", ["sdpa", "reference", "batch_invariant"])
@pytest.mark.parametrize("sink,window", CASES)
@pytest.mark.parametrize("t,s", [(13, 13), (3, 13)])
def test_full_forward_matches_eager(backend, sink, window, t, s):
    q, k, v, sinks = tensors(t, s)
    sinks = sinks if sink else None
    extra = {"sinks": sinks} if sink else {}
    if window:
        extra["window"] = window
    got = get_attention(backend)(q, k, v, causal=True, **extra)
    q_pos = torch.arange(s - t, s).expand(B, t)
    torch.testing.assert_close(got, eager(q, k, v, sinks, window, q_pos), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "reference", "batch_invariant"])
@pytest.mark.parametrize("sink,window", [c for c in CASES if c[0]] + [(None, 4)])
def test_cached_variant_matches_eager_at_mixed_positions(backend, sink, window):
    """Rows of different lengths in one call; slots past a row's position are padding."""
    q, k, v, sinks = tensors(2, 17, seed=1)
    q_pos = torch.tensor([[4, 5], [15, 16]])
    extra = {"sinks": sinks} if sink else {}
    if window:
        extra["window"] = window
    got = get_cached_attention(backend)(q, k, v, q_positions=q_pos, **extra)
    torch.testing.assert_close(got, eager(q, k, v, extra.get("sinks"), window, q_pos), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "batch_invariant"])
def test_gradients_match_the_reference(backend):
    window = 4
    grads = {}
    for name in (backend, "reference"):
        q, k, v, sinks = (x.clone().requires_grad_() for x in tensors(11, 11, seed=2))
        extra = {"sinks": sinks, **({"window": window} if window else {})}
        out = get_attention(name)(q, k, v, causal=True, **extra)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[name] = [x.grad for x in (q, k, v, sinks)]
    for ours, ref in zip(grads[backend], grads["reference"]):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert grads["reference"][3].abs().min() > 0


@pytest.mark.parametrize("sink,window", [("sinks", 0), (None, 3), ("sinks", 3)])
def test_batch_invariant_trainer_equals_generator_bitwise(sink, window):
    """A query's output from the full-sequence call (trainer) equals, bit for bit, the one from a
    KV-cache call over a longer padded context with other rows beside it (generator)."""
    q, k, v, sinks = tensors(9, 9, seed=3)
    extra = {"sinks": sinks} if sink else {}
    if window:
        extra["window"] = window
    full = get_attention("batch_invariant")(q, k, v, causal=True, **extra)
    pad = torch.randn(B, HKV, 7, D)
    k_ctx, v_ctx = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    for t in (0, 4, 8):
        step = get_cached_attention("batch_invariant")(q[:, :, t:t + 1], k_ctx, v_ctx,
                                                       q_positions=torch.full((B, 1), t), **extra)
        assert torch.equal(step[:, :, 0], full[:, :, t])


@pytest.mark.parametrize("keep0", [False, True])
def test_tiled_fallback_window_matches_eager(keep0):
    """The no-compiler fallback of the batch-invariant backend honours windows (and a sink key 0)."""
    from lockstep.ops.attention import with_sink_key
    from lockstep.ops.batch_invariant import tiled_attention_forward

    q, k, v, sinks = tensors(2, 17, seed=4)
    q_pos = torch.tensor([[4, 5], [15, 16]])
    want = eager(q, k, v, sinks if keep0 else None, 4, q_pos)
    if keep0:
        q, k, v = with_sink_key(q, k, v, sinks, D ** -0.5)
        q_pos = q_pos + 1
    got = tiled_attention_forward(q, k, v, q_pos, D ** -0.5, 4, keep0)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
