"""The activation memory policy (``memory`` pass) and the placement of recomputation (``recompute``):
bitwise equal to the graph before them, what gets recomputed and where it lands, budgets met."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lockstep.graph.config import GraphConfig
from lockstep.graph.passes import PassContext, analysis
from lockstep.graph.passes.analysis import peak_bytes
from lockstep.graph.passes.memory import _knapsack
from lockstep.graph.passes.pipeline import run_passes
from tests.graph.test_passes_pipeline import assert_bitwise, capture, llama, lm_step, run

ONLY_MEMORY = ["cleanup"]  # cleanup off too: the tests see exactly what the memory passes did


def _recomputed(gm):
    return [n for n in gm.graph.nodes if "recomputed_from" in n.meta]


def _check_placement(gm, record):
    """Every copy sits in the backward, before all its users, in the run of copies just before the
    backward op the record names; no original forward node is still read by a backward op."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    first_backward = min(order[n] for n in gm.graph.nodes if analysis.phase(n) == "backward")
    copies = _recomputed(gm)
    assert len(copies) == record["nodes_recomputed"] > 0
    for copy in copies:
        assert copy.meta["phase"] == "backward" and order[copy] > first_backward
        anchor = by_name[record["recomputed"][copy.meta["recomputed_from"]]]
        assert order[copy] < order[anchor]
        between = list(gm.graph.nodes)[order[copy]:order[anchor]]
        assert all("recomputed_from" in n.meta for n in between)
        assert all(order[u] > order[copy] for u in copy.users)
        assert copy.meta["recomputed_from"] not in by_name or not any(
            analysis.phase(u) == "backward" and "recomputed_from" not in u.meta
            for u in by_name[copy.meta["recomputed_from"]].users)


@pytest.mark.parametrize("bf16", [False, True])
def test_default_policy_is_bitwise_and_recomputes_only_cheap_ops(bf16):
    model, batch = llama()
    gm, args = capture(model, lm_step, batch, bf16)
    reference = run(gm, args)
    ctx = PassContext(GraphConfig(disable=ONLY_MEMORY))
    gm = run_passes(gm, ctx)
    assert_bitwise(run(gm, args), reference)
    memory, placed = ctx.records["memory"], ctx.records["recompute"]
    assert memory["saved_bytes_after"] < memory["saved_bytes_before"]
    assert placed["saved_bytes_after"] == memory["saved_bytes_after"] == analysis.saved_bytes(gm.graph)
    assert memory["refused"] == {}  # attention without dropout draws nothing; rmsnorm's add_ is local
    copies = _recomputed(gm)
    assert not any(analysis.is_expensive(c) for c in copies)
    assert any(c.target == torch.ops.aten.rsqrt.default for c in copies)  # norm intermediates
    assert placed["peak_bytes_after"] <= placed["peak_bytes_before"]
    if bf16:  # the bf16 casts of the weights are recomputed from the fp32 weights; the peak drops with them
        assert placed["peak_bytes_after"] < placed["peak_bytes_before"]
        assert any(c.target == torch.ops.aten._to_copy.default and c.args[0].op == "placeholder" for c in copies)
    _check_placement(gm, placed)


class _Tiny(torch.nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down = torch.nn.Linear(16, 4, bias=False)
        self.dropout = dropout

    def forward(self, x):
        hidden = F.dropout(F.gelu(self.up(x)), self.dropout, training=self.dropout > 0) * 2.0
        return self.down(hidden)


def _tiny_loss(call, x):
    return call(x).sum()


def test_chain_recomputed_before_first_backward_use():
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(3, 8)
    gm, args = capture(model, _tiny_loss, (x,))
    reference = run(gm, args)
    ctx = PassContext(GraphConfig(disable=ONLY_MEMORY))
    gm = run_passes(gm, ctx)
    assert_bitwise(run(gm, args), reference)
    copies = _recomputed(gm)
    # hidden = gelu(up(x)) * 2 is rebuilt from the kept matmul output; the matmul itself never is
    assert [c.target for c in copies] == [torch.ops.aten.gelu.default, torch.ops.aten.mul.Tensor]
    mul = copies[-1]
    anchor = next(iter(mul.users))
    assert anchor.meta["phase"] == "backward" and analysis.is_expensive(anchor)  # grad of down.weight
    assert ctx.records["recompute"]["recomputed"] == {c.meta["recomputed_from"]: anchor.name for c in copies}
    assert ctx.records["memory"]["saved_bytes_after"] == ctx.records["memory"]["saved_bytes_before"] - 3 * 16 * 4
    _check_placement(gm, ctx.records["recompute"])


@pytest.mark.parametrize("budget", [0.0, 0.3])
def test_random_draws_are_never_recomputed(budget):
    torch.manual_seed(0)
    model, x = _Tiny(dropout=0.5), torch.randn(3, 8)
    gm, args = capture(model, _tiny_loss, (x,))
    torch.manual_seed(1)
    reference = run(gm, args)
    ctx = PassContext(GraphConfig(disable=ONLY_MEMORY, memory_budget=budget))
    gm = run_passes(gm, ctx)
    torch.manual_seed(1)
    assert_bitwise(run(gm, args), reference)
    assert ctx.records["memory"]["refused"].get("rng", 0) >= 1
    assert not any(analysis.is_rng(c) for c in _recomputed(gm))
    assert sum(analysis.is_rng(n) for n in gm.graph.nodes) == 1  # still drawn once, in the forward


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_budget_is_met_bitwise(budget):
    model, batch = llama()
    gm, args = capture(model, lm_step, batch, bf16=True)
    reference = run(gm, args)
    ctx = PassContext(GraphConfig(disable=ONLY_MEMORY, memory_budget=budget))
    gm = run_passes(gm, ctx)
    assert_bitwise(run(gm, args), reference)
    memory = ctx.records["memory"]
    assert memory["budget_met"]
    assert memory["saved_bytes_after"] <= budget * memory["saved_bytes_before"]
    measured = analysis.saved_bytes(gm.graph)
    assert ctx.records["recompute"]["saved_bytes_after"] == memory["saved_bytes_after"] == measured
    if budget == 1.0:
        assert memory["groups_recomputed"] == 0 and not _recomputed(gm)
    else:
        _check_placement(gm, ctx.records["recompute"])


def test_knapsack_matches_brute_force():
    weights, values = [5, 4, 6, 3, 7, 2], [10.0, 40.0, 30.0, 50.0, 35.0, 5.0]
    for capacity in (0, 5, 10, 14, 27):
        keep = _knapsack(weights, values, capacity)
        assert sum(w for w, k in zip(weights, keep) if k) <= capacity
        best = max(sum(v for v, k in zip(values, c) if k) for c in itertools.product([0, 1], repeat=len(weights))
                   if sum(w for w, k in zip(weights, c) if k) <= capacity)
        assert sum(v for v, k in zip(values, keep) if k) == best


def test_peak_bytes_follows_liveness():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.exp.default, (x,))  # 4 x 4 fp32: 64 bytes
    view = graph.call_function(torch.ops.aten.view.default, (a, [16]))  # aliases a: no bytes of its own
    b = graph.call_function(torch.ops.aten.neg.default, (x,))
    c = graph.call_function(torch.ops.aten.add.Tensor, (b, 1.0))  # a (through its view) and b still alive
    d = graph.call_function(torch.ops.aten.sum.default, (view,))  # last use of a
    graph.output((c, d))
    for node in (x, a, b, c):
        node.meta["val"] = torch.empty(4, 4)
    view.meta["val"], d.meta["val"] = torch.empty(16), torch.empty(())
    assert peak_bytes(graph) == 3 * 64
