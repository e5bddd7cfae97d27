"""lockstep.graph.debug.first_divergence: silent on a faithful graph, names a deliberately wrong node."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lockstep.graph.config import GraphConfig
from lockstep.graph.debug import first_divergence
from lockstep.graph.passes import PassContext
from lockstep.graph.passes.pipeline import run_passes
from tests.graph.test_passes_memory import _Tiny
from tests.graph.test_passes_pipeline import capture, llama, lm_step


def _objective(model, batch):
    return lm_step(model, *batch)


def _autocast(bf16: bool):
    return (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext


@pytest.mark.parametrize("bf16", [False, True])
def test_faithful_graph_has_no_divergence(bf16):
    model, batch = llama()
    gm, args = capture(model, lm_step, batch, bf16)
    gm = run_passes(gm, PassContext(GraphConfig()))  # default passes: still bitwise
    assert first_divergence(model, _objective, batch, gm, args, autocast=_autocast(bf16)) is None


def test_wrong_node_is_named():
    model, batch = llama()
    gm, args = capture(model, lm_step, batch)
    gm = run_passes(gm, PassContext(GraphConfig()))
    # rmsnorm's "+ eps" of the second block's attention norm, made 1e-3 larger
    target = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.add_.Scalar
                  and n.meta["module_path"] == "layers.1.attention_norm")
    target.args = (target.args[0], target.args[1] + 1e-3)
    gm.recompile()
    found = first_divergence(model, _objective, batch, gm, args)
    assert found is not None
    assert (found.node, found.module_path, found.phase) == (target.name, "layers.1.attention_norm", "forward")
    assert found.op == "aten.add_.Scalar"
    assert 5e-4 < found.max_abs_diff <= 1e-3 + 1e-6  # the mean of squares shifted by 1e-3 (fp32 rounding)
    assert found.matched > 50
    assert "layers.1.attention_norm" in str(found)
    # a tolerance above the injected error lets it through to the first node that amplifies it
    later = first_divergence(model, _objective, batch, gm, args, atol=2e-3)
    assert later is not None and later.node_index > found.node_index


def test_random_ops_draw_the_same_numbers():
    torch.manual_seed(0)
    model, x = _Tiny(dropout=0.5), torch.randn(3, 8)
    gm, args = capture(model, lambda call, x: call(x).sum(), (x,))
    torch.manual_seed(5)
    assert first_divergence(model, lambda m, b: m(*b).sum(), (x,), gm, args) is None
