"""The numerics check of the graph trainer (``graph.check_steps``): where does a captured step first
compute other bits than eager?

:func:`first_divergence` runs the eager forward + loss + ``torch.autograd.grad`` of one micro-batch under a
``TorchDispatchMode`` that records every aten op and a copy of its outputs, in order, then runs the graph
with an ``fx.Interpreter`` recording each node's outputs, and walks the graph's nodes in order, matching
each to the next eager op with the same target and output shapes/dtypes (eager ops the passes removed are
skipped; recomputed copies are not matched, their users are). The first matched node whose outputs differ
(beyond ``atol``; 0 = any bit) is reported with its name, op, module path, phase and max abs difference.

The eager run takes the model's capture-time code paths (``lockstep.graph.state.capturing``: no host
reads, shape-static MoE dispatch), so its ops line up with the graph's. Both runs start from the same
random generator state, so random ops draw the same numbers. The records
hold a copy of every intermediate: meant for debug-sized models and a few steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lockstep.graph.state import capturing

#: how far ahead in the eager record a graph node's counterpart is looked for
_WINDOW = 256
#: ops whose outputs start as uninitialized memory
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _settle(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Zero what an op leaves unwritten, in both runs alike, so that garbage is not a difference:
    ``empty*`` outputs, and the rows of a ``_grouped_mm`` past its last group (MoE padding rows, which
    the model never reads back as results)."""
    name = getattr(func, "_opname", "")
    if name in _EMPTY and isinstance(out, torch.Tensor):
        out.zero_()
    elif name == "_grouped_mm" and isinstance(out, torch.Tensor) and out.dim() == 2:
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if isinstance(offs, torch.Tensor) and offs.numel():
            out[int(offs[-1]):].zero_()


@dataclasses.dataclass
class Divergence:
    """The first graph node whose output differs from the eager op it matched."""

    node: str
    op: str
    module_path: str
    phase: str
    max_abs_diff: float
    #: position of the node among the graph's nodes, and of its eager counterpart among the eager ops
    node_index: int
    eager_index: int
    #: graph nodes matched (and equal) before this one
    matched: int

    def __str__(self) -> str:
        return (f"first divergence at node {self.node} ({self.op}, {self.phase}, module "
                f"{self.module_path or '(none)'}): max |graph - eager| = {self.max_abs_diff:.3e} "
                f"after {self.matched} equal nodes")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _snapshot(value: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _tensors(value)]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        _settle(func, args, kwargs, out)
        self.ops.append((func, _snapshot(out)))
        return out


class _GraphRecorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[torch.fx.Node, list[torch.Tensor]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            _settle(n.target, args, kwargs, out)
            self.values[n] = _snapshot(out)
        return out


def record_eager(model: torch.nn.Module, objective: Callable, batch: Any, *,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 accumulate: int = 1) -> list[tuple[Any, list[torch.Tensor]]]:
    """Every aten op (and a copy of its outputs) of the eager forward + loss + grad, in order.
    ``objective(model, batch)`` returns the loss or ``(loss, report)``, as ``capture_step`` takes it."""
    params = [p for p in model.parameters() if p.requires_grad]
    recorder = _Recorder()
    # capturing(): the model takes the code paths it took while traced (no host reads, static shapes),
    # so the eager ops line up with the graph's nodes
    with capturing(), recorder, torch.enable_grad():
        with autocast():
            out = objective(model, batch)
            loss = (out[0] if isinstance(out, tuple) else out) / accumulate
        torch.autograd.grad(loss, params, allow_unused=True)
    return recorder.ops


def record_graph(gm: torch.fx.GraphModule, inputs: Any) -> dict[torch.fx.Node, list[torch.Tensor]]:
    """A copy of every aten node's outputs of one run of ``gm`` on ``inputs`` (its call arguments)."""
    recorder = _GraphRecorder(gm)
    with torch.no_grad():
        recorder.run(*pytree.tree_leaves(tuple(inputs)))
    return recorder.values


def _diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(got, want):
        if a.dtype != b.dtype:
            return float("inf")
        if torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)):
            continue
        d = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
        worst = max(worst, d.max().item() if d.numel() else 0.0)
    return worst


def _same_kind(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(got, want))


def compare(gm: torch.fx.GraphModule, graph_values: dict[torch.fx.Node, list[torch.Tensor]],
            eager_ops: list[tuple[Any, list[torch.Tensor]]], atol: float = 0.0) -> Divergence | None:
    """Match the graph's nodes to the eager ops in order; the first matched node differing by more than
    ``atol`` (any bit when 0), or None."""
    cursor, matched = 0, 0
    for index, node in enumerate(gm.graph.nodes):
        got = graph_values.get(node)
        if got is None or "recomputed_from" in node.meta:
            continue
        for j in range(cursor, min(cursor + _WINDOW, len(eager_ops))):
            func, want = eager_ops[j]
            if func == node.target and _same_kind(got, want):
                break
        else:
            continue
        cursor = j + 1
        diff = _diff(got, want)
        if diff > atol or (atol == 0 and diff > 0):
            return Divergence(node.name, str(node.target), node.meta.get("module_path", ""),
                              node.meta.get("phase", ""), diff, index, j, matched)
        matched += 1
    return None


def first_divergence(model: torch.nn.Module, objective: Callable, batch: Any, gm: torch.fx.GraphModule,
                     inputs: Any, *, autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     accumulate: int = 1, atol: float = 0.0) -> Divergence | None:
    """Run one micro-batch eagerly and through ``gm`` (called with ``inputs``, e.g.
    ``captured.inputs(batch_leaves)``) from the same generator state; the first diverging node or None.

    The eager side is ``objective(model, batch)`` under ``autocast``, divided by ``accumulate``, and its
    gradient w.r.t. the trainable parameters, as ``lockstep.graph.capture.capture_step`` traces it.
    Neither run changes the parameters; the generator state is left as after one step.
    """
    state = torch.get_rng_state()
    eager_ops = record_eager(model, objective, batch, autocast=autocast, accumulate=accumulate)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    graph_values = record_graph(gm, inputs)
    torch.set_rng_state(after)
    return compare(gm, graph_values, eager_ops, atol)
