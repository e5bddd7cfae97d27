"""Router math against hand-computed values (softmax/sigmoid, top-k normalisation, scaling,
group-limited selection, selection bias) and the balance helpers."""

import math

import pytest
import torch

from lockstep.models.common.moe_routing import (
    balance_bias_update,
    forced_balanced_indices,
    load_stats,
    route,
    sequence_balance_loss,
)


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sorted(weights, indices):
    order = indices.argsort(dim=-1)
    return weights.gather(-1, order), indices.gather(-1, order)


def test_softmax_topk_without_and_with_normalisation():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    z = math.e + math.e**2 + math.e**3 + 1.0
    w, idx, scores = route(logits, top_k=2, score_func="softmax", norm_topk_prob=False)
    assert idx[0].tolist() == [2, 1]
    torch.testing.assert_close(w, torch.tensor([[math.e**3 / z, math.e**2 / z]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(scores.sum(-1), torch.ones(1))
    w, idx, _ = route(logits, top_k=2, score_func="softmax", norm_topk_prob=True)
    # e^3 / (e^3 + e^2) = sigmoid(1)
    torch.testing.assert_close(w, torch.tensor([[1 / (1 + math.exp(-1)), 1 / (1 + math.e)]]), rtol=0, atol=1e-7)


def test_sigmoid_scores_normalisation_and_routed_scaling():
    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0), 2.0]])  # sigmoid: .5, .75, .25, .8808
    s3 = 1 / (1 + math.exp(-2.0))
    w, idx, scores = route(logits, top_k=2, score_func="sigmoid", norm_topk_prob=False)
    torch.testing.assert_close(scores, torch.tensor([[0.5, 0.75, 0.25, s3]]), rtol=0, atol=1e-7)
    assert idx[0].tolist() == [3, 1]
    torch.testing.assert_close(w, torch.tensor([[s3, 0.75]]), rtol=0, atol=1e-7)
    w, _, _ = route(logits, top_k=2, score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.5 * s3 / (s3 + 0.75), 2.5 * 0.75 / (s3 + 0.75)]]),
                               rtol=0, atol=1e-6)
    # Scaling without normalisation multiplies the raw scores.
    w, _, _ = route(logits, top_k=2, score_func="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.5 * s3, 2.5 * 0.75]]), rtol=0, atol=1e-6)


def test_group_limited_selection_only_picks_experts_in_the_top_groups():
    # 8 experts in 4 groups of 2. Group score = sum of the group's two best scores:
    # g0 = .90 + .01 = .91, g1 = .60 + .58 = 1.18, g2 = .57 + .56 = 1.13, g3 = .10 + .09 = .19.
    probs = [0.90, 0.01, 0.60, 0.58, 0.57, 0.56, 0.10, 0.09]
    logits = torch.tensor([[logit(p) for p in probs]])
    _, free, _ = route(logits, top_k=2, score_func="sigmoid")
    assert sorted(free[0].tolist()) == [0, 2]  # unrestricted: the single best expert wins
    w, idx, _ = route(logits, top_k=2, score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=False)
    assert sorted(idx[0].tolist()) == [2, 3]  # groups 1 and 2 only; expert 0's group lost
    w, idx = _sorted(w, idx)
    torch.testing.assert_close(w, torch.tensor([[0.60, 0.58]]), rtol=0, atol=1e-6)
    _, idx, _ = route(logits, top_k=3, score_func="sigmoid", n_group=4, topk_group=2)
    assert sorted(idx[0].tolist()) == [2, 3, 4]
    _, idx, _ = route(logits, top_k=2, score_func="sigmoid", n_group=4, topk_group=1)
    assert sorted(idx[0].tolist()) == [2, 3]


def test_group_limited_selection_on_random_logits_stays_inside_chosen_groups():
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    _, idx, scores = route(logits, top_k=4, score_func="sigmoid", n_group=4, topk_group=2)
    group_scores = scores.view(64, 4, 4).topk(2, dim=-1).values.sum(-1)
    allowed = group_scores.topk(2, dim=-1).indices
    for t in range(64):
        assert set((idx[t] // 4).tolist()) <= set(allowed[t].tolist())


def test_bias_changes_selection_but_weights_come_from_unbiased_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    scores = logits.softmax(-1)[0]
    w, idx, _ = route(logits, top_k=2, norm_topk_prob=False)
    assert idx[0].tolist() == [0, 1]
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])  # lifts expert 2 above expert 1 for the choice only
    w, idx, s = route(logits, top_k=2, norm_topk_prob=False, bias=bias)
    assert idx[0].tolist() == [2, 0]
    torch.testing.assert_close(w[0], torch.stack([scores[2], scores[0]]), rtol=0, atol=0)
    torch.testing.assert_close(s[0], scores, rtol=0, atol=0)
    w, _, _ = route(logits, top_k=2, norm_topk_prob=True, bias=bias)
    torch.testing.assert_close(w[0], torch.stack([scores[2], scores[0]]) / (scores[2] + scores[0]))


def test_forced_balanced_indices_are_round_robin_and_distinct():
    idx = forced_balanced_indices(6, 3, 4, torch.device("cpu"))
    assert idx.tolist() == [[0, 1, 2], [3, 0, 1], [2, 3, 0], [1, 2, 3], [0, 1, 2], [3, 0, 1]]
    assert torch.bincount(idx.flatten(), minlength=4).tolist() == [5, 5, 4, 4]
    big = forced_balanced_indices(96, 8, 128, torch.device("cpu"))
    assert all(len(set(row)) == 8 for row in big.tolist())
    assert torch.bincount(big.flatten(), minlength=128).tolist() == [6] * 128


def test_sequence_balance_loss_hand_values():
    # One sequence, T=2, E=2, k=1, both tokens choose expert 0.
    scores = torch.tensor([[[0.75, 0.25], [0.5, 0.5]]])
    idx = torch.tensor([[[0], [0]]])
    # f = E/(kT) * counts = [2, 0]; P = [.625, .375]; loss = 1.25
    assert sequence_balance_loss(scores, idx, 2, 1).item() == pytest.approx(1.25)
    # Uniform scores give exactly 1 whatever the choice; unnormalised (sigmoid) scores are normalised.
    uniform = torch.full((3, 5, 4), 0.3)
    idx = torch.randint(0, 4, (3, 5, 2))
    assert sequence_balance_loss(uniform, idx, 4, 2).item() == pytest.approx(1.0)


def test_load_stats_and_sign_bias_update():
    counts = torch.tensor([6, 2, 4, 4])
    lo, hi, cv = load_stats(counts).tolist()
    assert (lo, hi) == (2.0, 6.0)
    assert cv == pytest.approx(math.sqrt(2.0) / 4.0)
    bias = torch.zeros(4)
    balance_bias_update(bias, counts, 0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
