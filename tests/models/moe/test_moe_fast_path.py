"""The one-process MoE fast path: routing weights folded into the experts' activation.

``MoE.routed_and_shared`` hands a plain bias-free grouped_mm ``GroupedExperts`` each row's routing
weight, applied to the ``[rows, F]`` activation before the down projection instead of to the
``[rows, D]`` output. Same products, summed in another rounding order: the tests compare against the
unfolded form (the path every other expert module takes) with explicit bounds, and check which
modules fold."""

import pytest
import torch

from lockstep import numerics
from lockstep.models.common import moe as moe_mod
from lockstep.models.common.moe import GroupedExperts, MoEConfig


def _moe(**fields):
    torch.manual_seed(0)
    cfg = MoEConfig(**{"n_routed_experts": 6, "n_activated": 2, "moe_ffn_dim": 24, **fields})
    return cfg.build(dim=16, hidden_dim=64, init_std=0.2)


def _unfolded(monkeypatch):
    # the form used by the non-folding modules: weights applied to the experts' output
    monkeypatch.setattr(GroupedExperts, "folds_row_weights", lambda self: False)


def _run(moe, x, dtype):
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        y = moe(xi)
    probe = torch.linspace(-1, 1, y.shape[-1])
    (y.float() * probe).sum().backward()
    out = [y.detach().float(), xi.grad] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    return out


# fp32: (w * act) @ w2.T vs w * (act @ w2.T) differ by a few fp32 ulps of O(1) values (~1e-7 here);
# 1e-5 leaves headroom and still catches a wrong weight or row (O(1e-2) errors).
# bf16: the activation is rounded to bf16 after the weight multiply instead of the output after it,
# a bf16 ulp (2^-8 relative) of O(0.1..1) values; 2e-2 is a few ulps, a wrong row is O(1).
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("fields", [{}, {"n_shared_experts": 1}, {"score_func": "sigmoid", "routed_scaling_factor": 2.5}])
def test_folded_weights_match_unfolded_forward_and_backward(monkeypatch, dtype, atol, fields):
    moe = _moe(**fields)
    assert moe.experts.folds_row_weights()
    x = torch.randn(3, 11, 16)
    folded = _run(moe, x, dtype)
    _unfolded(monkeypatch)
    plain = _run(moe, x, dtype)
    assert len(folded) == len(plain) >= 6
    for a, b in zip(folded, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=atol * max(1.0, float(b.abs().max())))


def test_folded_path_is_really_taken(monkeypatch):
    """The folded path gives different bits from the unfolded one (else the test above tests nothing)."""
    moe = _moe()
    x = torch.randn(4, 16, 16)
    folded = _run(moe, x, torch.float32)
    _unfolded(monkeypatch)
    plain = _run(moe, x, torch.float32)
    assert not all(torch.equal(a, b) for a, b in zip(folded, plain))


def test_bf16_padding_keeps_folded_weights_on_their_rows(monkeypatch):
    """With the bf16 CPU row padding, each row keeps its own weight (padding rows weigh 0): padded
    (bucket 32) and unpadded (bucket 1) folded runs are bitwise equal."""
    moe = _moe(n_routed_experts=5, n_activated=3)
    x = torch.randn(2, 37, 16)
    runs = []
    for bucket in (1, 32):
        monkeypatch.setattr(moe_mod, "_CPU_ROW_BUCKET", bucket)
        runs.append(_run(moe, x, torch.bfloat16))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_which_modules_fold():
    assert _moe().experts.folds_row_weights()
    assert not _moe(experts_impl="loop").experts.folds_row_weights()
    assert not _moe(expert_bias=True).experts.folds_row_weights()
    moe = _moe()
    with numerics.batch_invariant(True):
        assert not moe.experts.folds_row_weights()

    class Sub(GroupedExperts):  # expert- / tensor-parallel experts are subclasses: they never fold
        pass

    assert not Sub(4, 8, 6).folds_row_weights()
    with pytest.raises(ValueError, match="row_weights"):
        _moe(experts_impl="loop").experts(torch.randn(3, 16), torch.tensor([1, 2, 0, 0, 0, 0]),
                                          row_weights=torch.ones(3))
