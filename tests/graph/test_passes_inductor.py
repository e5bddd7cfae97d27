"""The opt-in inductor pass: whole graph and tagged regions, within a stated tolerance of the graph
before it (numerics-changing, flagged), and its config errors. Kept to one tiny model: Inductor's CPU
compiles are slow here."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.utils import _pytree as pytree

from lockstep.config.base import ConfigError
from lockstep.graph.config import GraphConfig
from lockstep.graph.passes import PassContext, registered_passes, selected_passes
from lockstep.graph.passes.pipeline import run_passes
from tests.graph.test_passes_memory import _Tiny, _tiny_loss
from tests.graph.test_passes_pipeline import assert_bitwise, capture, run

# fp32 throughout. Inductor fuses the elementwise ops (gelu, the scale) into generated C++ and may sum in
# another order; the matmuls stay aten's. Values here are O(1), so a few fp32 ulps (eps 1.2e-7) is
# ~1e-6 absolute: rtol 1e-5 / atol 1e-6 bounds that with room, and catches any real error (>= 1e-3).
RTOL, ATOL = 1e-5, 1e-6


def _setup():
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(3, 8)
    gm, args = capture(model, _tiny_loss, (x,))
    return gm, args, run(gm, args)


def test_inductor_is_opt_in_and_flagged():
    assert registered_passes()["inductor"].changes_numerics
    assert "inductor" not in [p.name for p in selected_passes([], [])]
    assert [p.name for p in selected_passes(["inductor"], [])][-1] == "inductor"


def test_whole_graph_within_tolerance():
    gm, args, reference = _setup()
    ctx = PassContext(GraphConfig(enable=["inductor"]))
    gm = run_passes(gm, ctx)
    record = ctx.records["inductor"]
    assert record["partitions"] == 1 and record["changes_numerics"]
    assert not any(n.op == "call_function" and n.target is not operator.getitem
                   for n in gm.graph.nodes)  # every op is inside the compiled partition
    for got, want in zip(pytree.tree_leaves(run(gm, args)), pytree.tree_leaves(reference)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_region_compiles_only_its_nodes():
    gm, args, reference = _setup()
    ops_before = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    ctx = PassContext(GraphConfig(enable=["inductor"], inductor_regions=["up"], disable=["memory", "recompute"]))
    gm = run_passes(gm, ctx)
    record = ctx.records["inductor"]
    compiled = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert len(compiled) == record["partitions"] >= 1
    assert 0 < record["nodes_compiled"] < ops_before
    assert any(n.target == torch.ops.aten.gelu.default for n in gm.graph.nodes)  # "up" is only the matmul
    # the region is one matmul, which Inductor hands to the same aten kernel: the bits stay
    assert_bitwise(run(gm, args), reference)


def test_region_errors():
    gm, _, _ = _setup()
    with pytest.raises(ConfigError, match="graph.inductor_regions"):
        run_passes(gm, PassContext(GraphConfig(enable=["inductor"], inductor_regions=["layers.*.nothing"])))
    with pytest.raises(ConfigError, match="graph.inductor_regions"):
        GraphConfig(inductor_regions=["up"]).validate()
