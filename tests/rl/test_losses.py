"""GRPO-family losses (lockstep.rl.losses): hand-computed advantages, clipping, aggregation, KL, TIS,
gradients, and config / argument errors. Everything runs in float64 on tiny tensors.

Exact claims use ``torch.equal`` where every operation is exact in binary floating point (sums of
small dyadic numbers, exp(0) = 1, clamp, min). Where a value passes through log/exp/sqrt, the
tolerance is ``rtol=1e-12``: each of those rounds once to within 1 ulp (2.2e-16 relative in
float64), and a handful of them cannot come near 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.rl.losses import LossConfig, PolicyLoss, group_advantages

F64 = torch.float64
#: a few float64 log/exp/sqrt/divide roundings (each <= 1 ulp = 2.2e-16 relative) stay far below this
RTOL = 1e-12


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected, rtol: float = RTOL, atol: float = 1e-15) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=rtol, atol=atol)


def make_loss(kind: str = "grpo", max_response_length: int | None = None, **fields) -> PolicyLoss:
    return LossConfig(kind=kind, **fields).build(max_response_length=max_response_length)


def logps_with_ratios(old: list[float], ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp requiring grad, old_logp) for one sequence with exp(logp - old_logp) = ratios."""
    old_logp = t([old]).log()
    logp = (old_logp + t([ratios]).log()).requires_grad_(True)
    return logp, old_logp


# ---------------------------------------------------------------- advantages

def test_grpo_advantages_of_two_groups_and_zero_variance_filtering():
    rewards = t([[1.0, 0.0], [1.0, 1.0]])
    adv, kept = group_advantages(rewards, "grpo", eps=1e-6)
    # group 0: mean 0.5, deviations +-0.5, unbiased var = (0.25 + 0.25) / (2 - 1) = 0.5, std = sqrt(0.5)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # = 0.70710578...
    close(adv[0], [a, -a])
    # group 1: all rewards equal -> advantage exactly 0 (not 0 / eps noise)
    assert torch.equal(adv[1], t([0.0, 0.0]))
    assert torch.equal(kept, torch.tensor([True, True]))  # no filtering asked for: every group kept
    _, kept = group_advantages(rewards, "grpo", eps=1e-6, filter_zero_variance=True)
    assert torch.equal(kept, torch.tensor([True, False]))  # DAPO dynamic sampling drops group 1
    # DAPO uses GRPO's advantage
    assert torch.equal(group_advantages(rewards, "dapo", eps=1e-6)[0], adv)


def test_grpo_divides_by_the_unbiased_std():
    # [0, 0, 0, 4]: mean 1, deviations -1 -1 -1 3, sum of squares 12; unbiased var 12 / 3 = 4 -> std 2
    # (the population std would be sqrt(12 / 4) = sqrt(3)). Every step is exact in binary.
    adv, _ = group_advantages(t([[0.0, 0.0, 0.0, 4.0]]), "grpo", eps=0.0)
    assert torch.equal(adv, t([[-0.5, -0.5, -0.5, 1.5]]))


def test_dr_grpo_advantages_are_only_centred():
    adv, kept = group_advantages(t([[1.0, 0.0], [1.0, 1.0], [0.0, 4.0]]), "dr_grpo")
    assert torch.equal(adv, t([[0.5, -0.5], [0.0, 0.0], [-2.0, 2.0]]))  # r - mean, no std
    assert kept.all()
    # group_size 1 is fine without a std (advantage 0); GRPO's unbiased std needs 2 samples
    assert torch.equal(group_advantages(t([[3.0]]), "dr_grpo")[0], t([[0.0]]))


def test_equal_rewards_give_exactly_zero_advantage_despite_rounding():
    rewards = torch.full((1, 7), 0.7, dtype=torch.float32)
    # fp32: the mean of seven 0.7s is off by ~6e-8 and the std is ~6e-8, so the plain formula gives
    # ~-0.056 for every sample -- a spurious signal from a group with none. The function must not.
    naive = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    assert naive.abs().max() > 1e-2, "fp32 rounding no longer shows the hazard; pick other rewards"
    adv, kept = group_advantages(rewards, "grpo", eps=1e-6, filter_zero_variance=True)
    assert torch.equal(adv, torch.zeros_like(rewards))
    assert not kept.any()


def test_group_advantages_argument_errors():
    with pytest.raises(ValueError, match="rewards: expected \\[n_groups, group_size\\]"):
        group_advantages(t([1.0, 0.0]), "grpo")
    with pytest.raises(ValueError, match="rewards: .*group_size >= 2"):
        group_advantages(t([[1.0], [0.0]]), "grpo")
    with pytest.raises(ConfigError, match="kind: must be one of"):
        group_advantages(t([[1.0, 0.0]]), "ppo")


def test_policy_loss_advantages_flatten_group_major_with_keep_mask():
    loss = make_loss("dapo", filter_zero_variance_groups=True)
    adv, keep, metrics = loss.advantages(torch.tensor([[1, 0], [1, 1]]))  # integer rewards accepted
    assert adv.shape == (4,) and adv[0] > 0 and adv[1] < 0 and torch.equal(adv[2:], torch.zeros(2))
    assert torch.equal(keep, torch.tensor([True, True, False, False]))
    assert metrics["n_groups"].item() == 2 and metrics["n_groups_kept"].item() == 1


# ---------------------------------------------------------------- clipped surrogate

def test_clipped_surrogate_with_positive_advantage():
    # one 3-token sequence, A = +1, clip range [0.8, 1.2], ratios 1.5 / 0.5 / 1.0:
    #   token 0: min(1.5 * 1, 1.2 * 1) = 1.2 -> clipped branch (constant), loss -1.2, gradient 0
    #   token 1: min(0.5, 0.8) = 0.5        -> unclipped,                loss -0.5
    #   token 2: min(1.0, 1.0) = 1.0        -> loss -1.0
    # GRPO: mean over the 3 tokens = -(1.2 + 0.5 + 1.0) / 3 = -0.9
    logp, old = logps_with_ratios([0.4, 0.6, 0.3], [1.5, 0.5, 1.0])
    loss, metrics = make_loss("grpo")(logp, torch.ones(1, 3), t([1.0]), old_logp=old)
    close(loss, -0.9)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp (-ratio * A) / 3 = -ratio / 3 where unclipped; exactly 0 where the clip is active
    assert grad[0, 0].item() == 0.0
    close(grad[0, 1:], [-0.5 / 3, -1.0 / 3])
    close(metrics["clip_fraction"], 1 / 3)
    close(metrics["clip_fraction_high"], 1 / 3)
    assert metrics["clip_fraction_low"].item() == 0.0
    close(metrics["ratio_mean"], 1.0)  # (1.5 + 0.5 + 1.0) / 3
    close(metrics["ratio_max"], 1.5)


def test_clipped_surrogate_with_negative_advantage():
    # A = -1, same ratios; min now prefers the more negative product:
    #   token 0: min(-1.5, -1.2) = -1.5 -> unclipped (PPO does not clip here), loss 1.5
    #   token 1: min(-0.5, -0.8) = -0.8 -> clipped branch, loss 0.8, gradient 0
    #   token 2: loss 1.0
    # mean = (1.5 + 0.8 + 1.0) / 3 = 1.1
    logp, old = logps_with_ratios([0.4, 0.6, 0.3], [1.5, 0.5, 1.0])
    loss, metrics = make_loss("grpo")(logp, torch.ones(1, 3), t([-1.0]), old_logp=old)
    close(loss, 1.1)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 1].item() == 0.0
    close(grad[0, [0, 2]], [1.5 / 3, 1.0 / 3])  # -A * ratio / 3
    close(metrics["clip_fraction_low"], 1 / 3)
    assert metrics["clip_fraction_high"].item() == 0.0


def test_clip_higher_widens_only_the_upper_bound():
    logp, old = logps_with_ratios([0.5], [1.25])
    for clip_high, expected_loss, expected_grad in [(0.2, -1.2, 0.0), (0.28, -1.25, -1.25)]:
        loss, _ = make_loss("dapo", clip_high=clip_high)(logp, torch.ones(1, 1), t([1.0]), old_logp=old)
        (grad,) = torch.autograd.grad(loss, logp)
        close(loss, expected_loss)  # 1.25 is above 1.2 (clipped) but below 1.28 (not clipped)
        close(grad, [[expected_grad]])


# ---------------------------------------------------------------- aggregation

def _two_lengths():
    """Sequence 0: 1 response token, A = 2; sequence 1: 3 tokens, A = 1; T = 4 with padding NaN.
    On-policy (ratio exactly 1), so the per-token losses are exactly -2 and -1, -1, -1."""
    logp = t([[-0.5, math.nan, math.nan, math.nan], [-0.25, -1.0, -2.0, -math.inf]]).requires_grad_(True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    return logp, mask, t([2.0, 1.0])


@pytest.mark.parametrize("kind, expected, grads", [
    # GRPO: mean of per-sequence means = (-2/1 + -3/3) / 2 = -1.5; d/dlogp = -A / (|o_i| * 2)
    ("grpo", -1.5, [-1.0, -1 / 6]),
    # DAPO: sum over all 4 tokens / 4 = (-2 - 3) / 4 = -1.25; d/dlogp = -A / 4
    ("dapo", -1.25, [-0.5, -0.25]),
    # Dr.GRPO, max_response_length 4: sum / (2 sequences * 4) = -5 / 8 = -0.625; d/dlogp = -A / 8
    ("dr_grpo", -0.625, [-0.25, -0.125]),
])
def test_aggregation_rules_on_sequences_of_different_lengths(kind, expected, grads):
    logp, mask, adv = _two_lengths()
    loss, metrics = make_loss(kind, max_response_length=4)(logp, mask, adv)
    assert torch.equal(loss, t(expected))  # dyadic sums and divisions: exact
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad[0, 0], grads[0])
    close(grad[1, :3], [grads[1]] * 3)
    # NaN / -inf padding reaches neither the loss nor the gradient
    assert torch.equal(grad[0, 1:], torch.zeros(3, dtype=F64)) and grad[1, 3].item() == 0.0
    assert metrics["n_tokens"].item() == 4 and metrics["n_sequences"].item() == 2


def test_dr_grpo_needs_max_response_length():
    with pytest.raises(ValueError, match="max_response_length"):
        LossConfig(kind="dr_grpo").build()


def test_normaliser_lets_micro_batches_sum_to_the_full_batch_loss():
    logp, mask, adv = _two_lengths()
    for kind, normaliser in [("dapo", 4), ("grpo", 2), ("dr_grpo", 8)]:
        loss = make_loss(kind, max_response_length=4)
        full, _ = loss(logp, mask, adv)
        parts = [loss(logp[i:i + 1], mask[i:i + 1], adv[i:i + 1], normaliser=normaliser)[0] for i in range(2)]
        assert torch.equal(parts[0] + parts[1], full), kind
    with pytest.raises(ValueError, match="normaliser: must be > 0"):
        loss(logp, mask, adv, normaliser=0)


def test_fully_masked_batch_gives_zero_loss_and_zero_gradient():
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    for kind in ["grpo", "dapo", "dr_grpo"]:
        loss, metrics = make_loss(kind, max_response_length=2)(logp, torch.zeros(1, 2), t([1.0]))
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad)), kind
        assert metrics["n_tokens"].item() == 0


def test_zero_variance_filtering_removes_groups_from_the_loss():
    # groups [1, 0] and [1, 1]; sequences 0, 1 (group 0) have 2 and 1 tokens, 2, 3 (group 1) 3 and 2
    logp = t([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -1.0], [-3.0, -1.0, 0.0]]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    rewards = t([[1.0, 0.0], [1.0, 1.0]])
    for kind in ["grpo", "dapo"]:
        filtered = make_loss(kind, filter_zero_variance_groups=True)
        adv, keep, _ = filtered.advantages(rewards)
        loss, metrics = filtered(logp, mask, adv, keep=keep)
        # the same as a batch holding only group 0
        alone, _ = filtered(logp[:2], mask[:2], adv[:2])
        assert torch.equal(loss, alone), kind
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.equal(grad[2:], torch.zeros(2, 3, dtype=F64)), kind
        assert metrics["n_sequences"].item() == 2
    # without filtering, GRPO still counts group 1's two sequences (advantage 0) in the mean
    kept_all = make_loss("grpo")
    adv, keep, _ = kept_all.advantages(rewards)
    unfiltered, _ = kept_all(logp, mask, adv, keep=keep)
    filtered_loss, _ = make_loss("grpo", filter_zero_variance_groups=True)(logp, mask, adv, keep=torch.tensor([1, 1, 0, 0]))
    assert torch.equal(unfiltered * 2, filtered_loss)  # 4 sequences vs 2 in the denominator


# ---------------------------------------------------------------- KL and TIS

def test_k3_kl_at_known_values():
    # d = ref_logp - logp in {0, ln 2, -ln 2}; k3 = e^d - d - 1:
    #   d = 0     -> 1 - 0 - 1           = 0
    #   d = ln 2  -> 2 - ln 2 - 1        = 1 - ln 2   = 0.3069
    #   d = -ln 2 -> 0.5 + ln 2 - 1      = ln 2 - 0.5 = 0.1931
    # token mean = (1 - ln 2 + ln 2 - 0.5) / 3 = 1/6. With A = 0 the surrogate is 0, so the DAPO loss
    # is kl_coef / 6; d/dlogp k3 = 1 - e^d = 0, -1, 0.5, times kl_coef / 3 tokens.
    logp = t([[-1.0, -2.0, -0.5]]).requires_grad_(True)
    ref = logp.detach() + t([[0.0, math.log(2), -math.log(2)]])
    loss, metrics = make_loss("dapo", kl_coef=0.1)(logp, torch.ones(1, 3), t([0.0]), ref_logp=ref)
    close(metrics["kl"], 1 / 6)
    close(loss, 0.1 / 6)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, -0.1 / 3, 0.05 / 3]])
    # kl_coef = 0: the KL is still reported but adds nothing
    loss, metrics = make_loss("dapo")(logp, torch.ones(1, 3), t([0.0]), ref_logp=ref)
    assert loss.item() == 0.0
    close(metrics["kl"], 1 / 6)


def test_tis_weights_are_capped_and_detached():
    # old_logp - generator_logp = ln 3, ln 0.5, 0 -> exp = 3, 0.5, 1 -> capped at 2: w = 2, 0.5, 1.
    # On-policy with A = 1 each surrogate term is -1, weighted: -2, -0.5, -1; DAPO mean = -3.5 / 3.
    # The weight is a constant: d/dlogp = -w / 3.
    logp = t([[-1.0, -2.0, -0.5]]).requires_grad_(True)
    gen = (logp.detach() - t([[math.log(3), math.log(0.5), 0.0]])).requires_grad_(True)
    loss, metrics = make_loss("dapo", tis_cap=2.0)(logp, torch.ones(1, 3), t([1.0]), generator_logp=gen)
    close(loss, -3.5 / 3)
    grad, grad_gen = torch.autograd.grad(loss, [logp, gen], allow_unused=True)
    close(grad, [[-2 / 3, -0.5 / 3, -1 / 3]])
    assert grad_gen is None
    close(metrics["tis_weight_mean"], 3.5 / 3)
    close(metrics["tis_capped_fraction"], 1 / 3)


def test_loss_is_differentiable_with_respect_to_logp_only():
    logp = t([[-1.0, -2.0], [-0.5, -0.7]]).requires_grad_(True)
    others = {name: (logp.detach() + shift).requires_grad_(True)
              for name, shift in [("old_logp", 0.1), ("ref_logp", -0.2), ("generator_logp", 0.05)]}
    adv = t([1.0, -1.0]).requires_grad_(True)
    loss, _ = make_loss("grpo", kl_coef=0.05, tis_cap=2.0)(logp, torch.ones(2, 2), adv, **others)
    grads = torch.autograd.grad(loss, [logp, adv, *others.values()], allow_unused=True)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    assert all(g is None for g in grads[1:])


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("fields, message", [
    ({"kind": "ppo"}, "loss.kind: must be one of"),
    ({"clip_low": -0.1}, "loss.clip_low: must be in \\[0, 1\\)"),
    ({"clip_low": 1.0}, "loss.clip_low: must be in \\[0, 1\\)"),
    ({"clip_high": -0.1}, "loss.clip_high: must be >= 0"),
    ({"kl_coef": -0.01}, "loss.kl_coef: must be >= 0"),
    ({"tis_cap": 0.5}, "loss.tis_cap: must be 0 \\(off\\) or >= 1"),
    ({"adv_eps": -1e-6}, "loss.adv_eps: must be >= 0"),
])
def test_config_errors_name_the_field(fields, message):
    config = LossConfig(**fields)
    with pytest.raises(ConfigError, match=message):
        config.validate()
    with pytest.raises(ConfigError, match=message):
        config.build(max_response_length=8)  # build validates too
    with pytest.raises(ConfigError, match="rl.loss."):
        config.validate("rl.loss")


def test_default_config_is_valid_and_builds():
    loss = LossConfig().build()
    assert isinstance(loss, PolicyLoss) and loss.config.kind == "grpo"


def test_argument_errors_name_the_argument():
    logp, mask = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3)
    loss = make_loss("grpo")
    with pytest.raises(ValueError, match="mask: expected shape \\[2, 3\\]"):
        loss(logp, torch.ones(2, 4), t([1.0, 1.0]))
    with pytest.raises(ValueError, match="advantages: expected \\[2\\] or \\[2, 3\\]"):
        loss(logp, mask, t([1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="old_logp: expected shape"):
        loss(logp, mask, t([1.0, 1.0]), old_logp=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="keep: expected shape \\[2\\]"):
        loss(logp, mask, t([1.0, 1.0]), keep=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="ref_logp: required when kl_coef > 0"):
        make_loss("grpo", kl_coef=0.1)(logp, mask, t([1.0, 1.0]))
    with pytest.raises(ValueError, match="generator_logp: required when tis_cap > 0"):
        make_loss("grpo", tis_cap=2.0)(logp, mask, t([1.0, 1.0]))
