"""The MoE layer: grouped experts equal a per-token loop, forced balance, aux-loss-free bias,
metrics and losses, config validation, overrides and init."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.config.base import ConfigError
from lockstep.config.components import component_kinds, parse_override
from lockstep.models.common.moe import MoE, MoEConfig
from lockstep.models.common.moe_routing import route
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config

# fp32 throughout: grouped and naive paths run the same matmuls on the same values and differ only
# in reduction order (and in the order the k expert outputs of a token are summed), i.e. a few fp32
# ulps of O(1) outputs (~1e-7); 1e-5 leaves two orders of magnitude of headroom while still
# catching any wrong expert, weight or token permutation (those give O(1e-2) errors or worse).
ATOL = 1e-5


def _moe(impl="auto", std=0.2, seed=0, **fields) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"n_routed_experts": 6, "n_activated": 2, "moe_ffn_dim": 24, "experts_impl": impl, **fields})
    return cfg.build(dim=16, hidden_dim=64, init_std=std)


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference: route, then sum weight * expert(x) over the chosen experts."""
    flat = x.reshape(-1, x.shape[-1])
    cfg = moe.config
    weights, indices, _ = route(flat @ moe.gate.weight.T, top_k=cfg.n_activated, score_func=cfg.score_func,
                                norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
                                n_group=cfg.n_group, topk_group=cfg.topk_group, bias=moe.e_score_correction_bias)
    ex = moe.experts
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(flat.shape[1])
        for j in range(cfg.n_activated):
            e = int(indices[t, j])
            h = F.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t])
            acc = acc + weights[t, j] * (ex.w2[e] @ h)
        if moe.shared_experts is not None:
            acc = acc + moe.shared_experts(flat[t])
        rows.append(acc)
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize("fields", [
    {},
    {"n_shared_experts": 1, "norm_topk_prob": False},
    {"score_func": "sigmoid", "routed_scaling_factor": 2.5, "n_group": 3, "topk_group": 2},
])
def test_grouped_experts_equal_naive_per_token_loop(impl, fields):
    moe = _moe(impl, **fields)
    with torch.no_grad():
        moe.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 6))
    x = torch.randn(3, 7, 16)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=0, atol=ATOL)


def test_grouped_mm_and_loop_agree_in_forward_and_backward():
    x = torch.randn(4, 9, 16)
    outs = {}
    for impl in ("grouped_mm", "loop"):
        moe = _moe(impl, n_shared_experts=1)
        xi = x.clone().requires_grad_()
        y = moe(xi)
        y.sum().backward()  # .sum() gives an expanded (stride-0) grad: grouped_mm must cope
        outs[impl] = (y.detach(), xi.grad, moe.experts.w1.grad, moe.experts.w2.grad, moe.gate.weight.grad)
    for a, b in zip(outs["grouped_mm"], outs["loop"]):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


@settings(max_examples=15, deadline=None)
@given(n_experts=st.integers(1, 9), k=st.integers(1, 4), tokens=st.integers(1, 12), seed=st.integers(0, 99))
def test_grouped_equals_naive_for_any_shape(n_experts, k, tokens, seed):
    k = min(k, n_experts)
    moe = _moe("grouped_mm", seed=seed, n_routed_experts=n_experts, n_activated=k)
    x = torch.randn(1, tokens, 16)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=0, atol=ATOL)


def test_bf16_autocast_grouped_path_runs_in_bf16_and_backprops():
    moe = _moe("grouped_mm")
    x = torch.randn(2, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.float32  # the residual stream's dtype is kept
    torch.testing.assert_close(y, naive_moe(moe, x).detach(), rtol=0, atol=5e-2)
    y.square().sum().backward()
    assert torch.isfinite(moe.experts.w2.grad).all() and moe.experts.w2.grad.abs().sum() > 0


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_row_padding_of_grouped_mm_is_bitwise_invisible(monkeypatch, bias):
    """On CPU, bf16 expert groups are zero-padded to a row multiple (oneDNN primitive reuse): the
    outputs and every gradient equal the unpadded computation bitwise (bucket 1 pads nothing)."""
    from lockstep.models.common import moe as moe_mod

    torch.manual_seed(0)
    experts = moe_mod.GroupedExperts(6, 64, 48, impl="grouped_mm", bias=bias)
    if bias:
        for b in (experts.b1, experts.b2, experts.b3):
            torch.nn.init.normal_(b)
    x = torch.randn(301, 64)
    counts = torch.tensor([0, 1, 97, 33, 170, 0])
    probe = torch.randn(64)
    results = {}
    for bucket in (1, 32):
        monkeypatch.setattr(moe_mod, "_CPU_ROW_BUCKET", bucket)
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = experts(xi, counts)
        (y.float() * probe).sum().backward()
        results[bucket] = [y.detach(), xi.grad] + [p.grad for p in experts.parameters()]
    assert len(results[1]) == (8 if bias else 5)  # y, x.grad, w1-w3 (+ b1-b3)
    for a, b in zip(results[1], results[32]):
        assert torch.equal(a, b)


def test_forced_balanced_gives_exactly_equal_load_and_uniform_weights():
    moe = _moe(routing="forced_balanced", n_routed_experts=8, n_activated=2)
    assert moe.routing_mode == "forced_balanced"
    x = torch.randn(4, 8, 16)  # 32 tokens * 2 / 8 experts = 8 each
    y = moe(x)
    y.sum().backward()
    assert torch.equal(moe.gate.weight.grad, torch.zeros_like(moe.gate.weight))  # in the graph, no signal
    y = y.detach()
    _, metrics = moe.pop_auxiliary()
    assert metrics["load_min"] == metrics["load_max"] == 8.0
    assert metrics["load_cv"] == 0.0
    flat = x.reshape(-1, 16)
    ex = moe.experts
    t = 5  # token 5 -> experts 10 % 8 = 2 and 3, each with weight 1/2
    ref = sum(0.5 * (ex.w2[e] @ (F.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t]))) for e in (2, 3))
    torch.testing.assert_close(y.reshape(-1, 16)[t], ref, rtol=0, atol=ATOL)


def test_aux_loss_free_bias_moves_toward_balance_and_has_no_grad():
    torch.manual_seed(0)
    moe = MoEConfig(n_routed_experts=4, n_activated=1, moe_ffn_dim=8, bias_update_speed=0.02).build(dim=16, hidden_dim=8)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        moe.gate.weight[0, 0] = 4.0  # feature 0 is constant 1: expert 0 is preferred by ~4 logits
    x = torch.randn(128, 16)
    x[:, 0] = 1.0
    bias = moe.e_score_correction_bias
    assert not bias.requires_grad and "e_score_correction_bias" not in dict(moe.named_parameters())
    assert "e_score_correction_bias" in moe.state_dict()  # checkpointed with the model
    moe.eval()
    moe(x)
    first_cv = moe.pop_auxiliary()[1]["load_cv"]
    assert torch.equal(bias, torch.zeros(4))  # eval forwards never update it
    moe.train()
    y = moe(x)
    y.square().sum().backward()
    assert bias.grad is None and moe.gate.weight.grad is not None
    assert torch.equal(bias, torch.zeros(4))  # the forward only counts; the step applies
    moe.apply_routing_update()
    torch.testing.assert_close(bias, torch.tensor([-0.02, 0.02, 0.02, 0.02]))  # one sign step
    cvs = []
    with torch.no_grad():
        for _ in range(60):
            moe(x)
            cvs.append(moe.pop_auxiliary()[1]["load_cv"])
            moe.apply_routing_update()
    assert bias[0] < 0 and (bias[1:] > 0).all()
    late = sum(cvs[-10:]) / 10  # sign updates oscillate around balance; average the tail
    assert first_cv > 1.5 and late < 0.5 * first_cv, (first_cv, cvs)


def test_bias_update_off_by_default_and_in_forced_mode():
    for moe in (_moe(), _moe(routing="forced_balanced", bias_update_speed=0.1)):
        moe.train()
        moe(torch.randn(2, 5, 16))
        moe.apply_routing_update()
        assert torch.equal(moe.e_score_correction_bias, torch.zeros(6))


def test_metrics_and_sequence_aux_loss_are_reported_and_cleared():
    moe = _moe(seq_aux_loss_coef=0.01, bias_update_speed=0.001)
    moe.train()
    x = torch.randn(2, 5, 16)
    moe(x)
    losses, metrics = moe.pop_auxiliary()
    assert set(metrics) == {"load_min", "load_max", "load_cv", "dropped_tokens", "bias_absmax"}
    assert metrics["dropped_tokens"] == 0.0
    assert metrics["load_min"] <= 2 * 10 / 6 <= metrics["load_max"]
    assert set(losses) == {"seq_aux_loss"} and losses["seq_aux_loss"].requires_grad
    assert 0 < losses["seq_aux_loss"].item() < 0.01 * 6  # coef * loss, loss in (0, E]
    assert moe.pop_auxiliary() == ({}, {})
    moe.eval()
    moe(x)
    losses, metrics = moe.pop_auxiliary()
    assert losses == {} and "load_cv" in metrics  # no aux loss outside training
    # Uniform router: the balance loss is exactly coef * 1.
    moe.train()
    with torch.no_grad():
        moe.gate.weight.zero_()
    moe(x)
    assert moe.pop_auxiliary()[0]["seq_aux_loss"].item() == pytest.approx(0.01)


def test_transformer_collects_moe_aux_by_module_path():
    cfg = model_config("qwen3_moe", "debug")
    cfg = dataclasses.replace(cfg, feed_forward=dataclasses.replace(cfg.feed_forward, seq_aux_loss_coef=1e-3))
    model = build_model(cfg)
    model.train()
    model(torch.randint(0, cfg.vocab_size, (2, 12)))
    losses, metrics = model.pop_auxiliary()
    assert set(losses) == {"layers.0.feed_forward/seq_aux_loss", "layers.1.feed_forward/seq_aux_loss"}
    assert "layers.1.feed_forward/load_cv" in metrics


@pytest.mark.parametrize("changes, field", [
    ({"n_activated": 9}, "n_activated"),
    ({"n_activated": 0}, "n_activated"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"n_group": 4, "topk_group": 1, "n_activated": 3}, "topk_group"),
    ({"score_func": "relu"}, "score_func"),
    ({"routing": "random"}, "routing"),
    ({"experts_impl": "triton"}, "experts_impl"),
    ({"bias_update_speed": -1.0}, "bias_update_speed"),
    ({"seq_aux_loss_coef": -1.0}, "seq_aux_loss_coef"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
])
def test_validation_names_the_field(changes, field):
    cfg = MoEConfig(**{"n_routed_experts": 8, "n_activated": 2, **changes})
    with pytest.raises(ConfigError, match=rf"feed_forward\.{field}"):
        cfg.validate("model.feed_forward")


def test_moe_is_an_override_kind_on_a_dense_model():
    assert "moe" in component_kinds()
    base = model_config("llama3", "debug")
    override = parse_override("layers.1.feed_forward=moe,n_routed_experts=4,n_activated=2,moe_ffn_dim=32")
    model = build_model(dataclasses.replace(base, overrides=[override]))
    assert isinstance(model.layers["1"].feed_forward, MoE) and not isinstance(model.layers["0"].feed_forward, MoE)
    assert model(torch.randint(0, base.vocab_size, (1, 8))).shape == (1, 8, base.vocab_size)


def test_meta_build_initialises_experts_and_bias():
    cfg = dataclasses.replace(model_config("qwen3_moe", "tiny"), vocab_size=512)
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    ff = a.layers["0"].feed_forward
    for w in (ff.experts.w1, ff.experts.w3, ff.gate.weight):
        assert abs(w.std().item() - 0.02) < 0.002
        assert abs(w.mean().item()) < 0.002
    # expert down projections write into the residual stream: depth-scaled like dense w2
    depth_std = 0.02 / (2 * cfg.n_layers) ** 0.5
    assert abs(ff.experts.w2.std().item() - depth_std) < 0.001
    assert torch.equal(ff.e_score_correction_bias, torch.zeros(16))
