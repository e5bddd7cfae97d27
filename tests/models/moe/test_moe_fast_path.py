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
    monkeypatch.setattr(GroupedExperts, "fuses_routing", lambda self: False)


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
@pytest.mark.parametrize("fields", [{}, {"n_shared_experts": 1},
                                    {"score_func": "sigmoid", "routed_scaling_factor": 2.5}])
def test_folded_weights_match_unfolded_forward_and_backward(monkeypatch, dtype, atol, fields):
    moe = _moe(**fields)
    assert moe.experts.fuses_routing()
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
    assert _moe().experts.fuses_routing()
    assert not _moe(experts_impl="loop").experts.fuses_routing()
    assert not _moe(expert_bias=True).experts.fuses_routing()
    moe = _moe()
    with numerics.batch_invariant(True):
        assert not moe.experts.fuses_routing()

    from torch.distributed.fsdp import FSDPModule

    from lockstep.parallel.expert import ExpertParallelExperts, TensorParallelExperts

    # expert- / tensor-parallel experts keep dispatch and combine outside: they never fold
    assert not ExpertParallelExperts.takes_routing and not TensorParallelExperts.takes_routing
    # FSDP2 swaps a sharded module's class for a generated subclass with the same forward: it still
    # folds, as one process does (else FSDP2 and the traceable FSDP / one process round differently)
    fsdp_experts = moe.experts
    fsdp_experts.__class__ = type("FSDPGroupedExperts", (FSDPModule, GroupedExperts), {})
    assert fsdp_experts.fuses_routing()
    with pytest.raises(ValueError, match="row_weights"):
        _moe(experts_impl="loop").experts(torch.randn(3, 16), torch.tensor([1, 2, 0, 0, 0, 0]),
                                          row_weights=torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_inside_the_experts_is_bitwise_the_plain_gather(dtype):
    """``experts(x, counts, token=token)`` (bf16 on CPU: one gather-cast-pad pass, its backward an
    fp32 index_add_ in row order) equals ``experts(x[token], counts)`` bitwise: output, input grad,
    routing-weight grad and weight grads."""
    torch.manual_seed(0)
    experts = GroupedExperts(5, 16, 24, impl="grouped_mm")  # bf16 grouped_mm: 16-byte strides
    tokens, k = 23, 3
    token = torch.randperm(tokens * k) // k  # each token k times, in a sorted-by-expert order
    counts = torch.tensor([0, 31, 5, 33, 0])
    probe = torch.randn(16)
    results = []
    for inside in (True, False):
        x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = torch.rand(tokens * k, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = (experts(x, counts, row_weights=w, token=token) if inside
                 else experts(x[token], counts, row_weights=w))
        (y.float() * probe).sum().backward()
        results.append([y.detach(), x.grad, w.grad] + [p.grad.clone() for p in experts.parameters()])
        experts.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.equal(a, b)
