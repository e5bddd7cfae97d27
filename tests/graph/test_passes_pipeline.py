"""The pass pipeline (lockstep.graph.passes.pipeline), the cleanup pass and the graph dump.

``capture`` here (the trainer's ``capture_step`` on a loss function) and the helpers below are shared by
the other pass tests.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from lockstep.config.base import ConfigError
from lockstep.graph.capture import capture_step
from lockstep.graph.config import GraphConfig
from lockstep.graph.dump import summarize
from lockstep.graph.passes import PassContext, registered_passes, selected_passes
from lockstep.graph.passes import analysis
from lockstep.graph.passes.pipeline import run_passes
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.run.objective import lm_loss


def capture(model: torch.nn.Module, loss_fn, batch: tuple, bf16: bool = False):
    """(graph module, its call arguments) of ``loss_fn(model, *batch)`` and its gradients, captured as
    the trainer captures them (``capture_step``; the report is the loss)."""
    def objective(m, b):
        loss = loss_fn(m, *b)
        return loss, loss.detach()

    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    captured, leaves = capture_step(model, objective, tuple(batch), autocast=autocast)
    return captured.gm, captured.inputs(leaves)


def lm_step(call, x, y):
    return lm_loss(call(x), y)


def llama(seed: int = 0, T: int = 16):
    cfg = model_config("llama3", "debug")
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    batch = tuple(torch.randint(0, cfg.vocab_size, (2, T), generator=gen) for _ in range(2))
    return model, batch


def run(gm, args):
    with torch.no_grad():
        return gm(*args)


def assert_bitwise(a, b):
    flat_a, flat_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        assert (x is None and y is None) or torch.equal(x, y)


def count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == target)


@pytest.mark.parametrize("bf16", [False, True])
def test_cleanup_keeps_bits_and_removes_noops(bf16):
    model, batch = llama()
    gm, args = capture(model, lm_step, batch, bf16)
    reference = run(gm, args)
    detaches = count(gm, torch.ops.aten.detach.default)
    assert detaches > 0
    ctx = PassContext(GraphConfig(disable=[p for p in registered_passes() if p != "cleanup"]))
    gm = run_passes(gm, ctx)
    assert_bitwise(run(gm, args), reference)
    record = ctx.records["cleanup"]
    # only the loss.detach() feeding the output stays
    assert count(gm, torch.ops.aten.detach.default) == 1
    assert record["removed_noops"]["aten.detach.default"] == detaches - 1
    assert record["nodes_after"] < record["nodes_before"]
    # and a fresh batch still matches eager through the rewritten graph
    _, other = llama(seed=1)
    eager_gm, _ = capture(model, lm_step, other, bf16)
    other_args = (*args[:-1], list(other))  # parameters, buffers, module state, then the batch
    assert_bitwise(run(gm, other_args), run(eager_gm, other_args))


def test_cleanup_dead_code_keeps_side_effects():
    def f(x):
        dead = torch.exp(x)  # noqa: F841 (dead: removed)
        drawn = torch.rand_like(x)  # noqa: F841 (unused draw: kept, it advances the generator)
        y = x.view(x.shape) * 2  # view to the same shape: removed
        return y.clone(), torch.rand_like(x)

    gm = make_fx(f)(torch.randn(4, 3))
    assert count(gm, torch.ops.aten.exp.default) == 1
    ctx = PassContext(GraphConfig(disable=[p for p in registered_passes() if p != "cleanup"]))
    gm = run_passes(gm, ctx)
    assert count(gm, torch.ops.aten.exp.default) == 0
    assert count(gm, torch.ops.aten.rand_like.default) == 2
    assert count(gm, torch.ops.aten.view.default) == 0
    assert count(gm, torch.ops.aten.clone.default) == 1  # feeds the output: never aliased away
    x = torch.randn(4, 3)
    torch.manual_seed(3)
    expected = f(x)
    torch.manual_seed(3)
    assert_bitwise(gm(x), expected)


def test_copy_of_written_tensor_is_kept():
    def f(x):
        y = x * 2
        z = y.clone()
        y.add_(1)
        return z + y

    gm = make_fx(f)(torch.randn(3))
    ctx = PassContext(GraphConfig(disable=[p for p in registered_passes() if p != "cleanup"]))
    gm = run_passes(gm, ctx)
    assert count(gm, torch.ops.aten.clone.default) == 1
    assert count(gm, torch.ops.aten.add_.Tensor) == 1
    x = torch.randn(3)
    assert torch.equal(gm(x), f(x))


def test_pipeline_order_and_names():
    names = [p.name for p in selected_passes([], [])]
    assert names[:3] == ["cleanup", "memory", "recompute"]
    assert "inductor" not in names
    with pytest.raises(ConfigError, match="graph.enable"):
        GraphConfig(enable=["no_such_pass"]).validate()


def test_dump_writes_code_and_summary(tmp_path):
    model, batch = llama()
    gm, args = capture(model, lm_step, batch)
    ctx = PassContext(GraphConfig(dump_dir=str(tmp_path)))
    gm = run_passes(gm, ctx)
    names = [p.name for p in selected_passes([], [])]
    files = sorted(p.name for p in tmp_path.iterdir())
    for index, name in enumerate(["captured", *names]):
        assert f"{index:02d}_{name}.py" in files
        assert f"{index:02d}_{name}_summary.json" in files
    assert "def forward" in (tmp_path / "01_cleanup.py").read_text()
    summary = json.loads((tmp_path / "01_cleanup_summary.json").read_text())
    layers = model_config("llama3", "debug").n_layers
    assert {f"layers.{i}" for i in range(layers)} <= set(summary["blocks"])
    assert summary["nodes"] == ctx.records["cleanup"]["nodes_after"]
    assert summary["saved_bytes"] == sum(b["saved_bytes"] for b in summary["blocks"].values()) > 0
    assert summary["blocks"]["layers.0"]["saved_bytes"] > 0
    assert summary["collectives"] == 0
    assert summary["records"]["removed_dead"] >= 0
    captured = json.loads((tmp_path / "00_captured_summary.json").read_text())
    assert captured["saved_bytes"] == analysis.saved_bytes(capture(model, lm_step, batch)[0].graph)


def test_summary_counts_collectives_per_block():
    # built by hand: a summary needs no process group, only the nodes
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta.update(val=torch.empty(4, 8), phase="", module_path="")
    gathered = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (gathered,))
    scattered = graph.call_function(torch.ops._c10d_functional.reduce_scatter_tensor.default, (waited, "sum", 2, "0"))
    for node, path in ((gathered, "layers.2.attention"), (waited, "layers.2.attention"), (scattered, "norm")):
        node.meta.update(val=torch.empty(8, 8), phase="forward", module_path=path)
    graph.output(scattered)
    summary = summarize(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert summary["collectives"] == 2  # the wait is no collective of its own
    assert summary["blocks"]["layers.2"]["collectives"] == {"_c10d_functional.all_gather_into_tensor.default": 1}
    assert summary["blocks"]["norm"]["collectives"] == {"_c10d_functional.reduce_scatter_tensor.default": 1}
    assert summary["blocks"]["layers.2"]["nodes"] == {"forward": 2}


def test_same_dtype_copy_and_cast_removed():
    def f(x):
        y = x * 2
        same = y.to(torch.float32, copy=True)  # _to_copy to its own dtype: a no-op copy
        cast = y.to(torch.bfloat16)  # a real cast: kept
        return same + 1, cast

    gm = make_fx(f)(torch.randn(3))
    assert count(gm, torch.ops.aten._to_copy.default) == 2
    ctx = PassContext(GraphConfig(disable=[p for p in registered_passes() if p != "cleanup"]))
    gm = run_passes(gm, ctx)
    assert count(gm, torch.ops.aten._to_copy.default) == 1
    assert ctx.records["cleanup"]["removed_noops"] == {"aten._to_copy.default": 1}
    x = torch.randn(3)
    assert_bitwise(gm(x), f(x))


def test_copy_returned_through_a_view_is_kept():
    def f(x):
        y = x * 2
        return y, y.clone().view(-1)  # without the clone the two outputs would share storage

    gm = make_fx(f)(torch.randn(2, 3))
    ctx = PassContext(GraphConfig(disable=[p for p in registered_passes() if p != "cleanup"]))
    gm = run_passes(gm, ctx)
    assert count(gm, torch.ops.aten.clone.default) == 1
    a, b = gm(torch.randn(2, 3))
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
