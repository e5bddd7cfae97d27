"""The GraphTrainer's step: run micro-batches through captured graphs at the runtime's step seam.

:class:`GraphStep` keeps one captured graph per key -- the batch's structure, tensor shapes/dtypes and
non-tensor values, the module state's structure (``state_signature``), ``accumulate``, the autocast
dtype, the objective and the model's mode -- capturing (``lockstep.graph.capture.capture_step``) and
rewriting it with the selected passes (``lockstep.graph.passes.pipeline.run_passes``) on first use, and
counting captures (``captures``; a new shape re-captures and logs a line). Each micro-batch replays its
graph and writes the gradients into ``.grad`` as autograd's accumulation would: the first micro-batch
of a step sets them, later ones add in place.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from lockstep.graph.capture import CapturedStep, capture_step
from lockstep.graph.config import GraphConfig
from lockstep.graph.passes import PassContext, selected_passes
from lockstep.graph.state_attrs import state_signature

log = logging.getLogger(__name__)

#: captured graphs kept at once (an RL step's batches can each need their own)
MAX_CACHED = 8


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.device, x.requires_grad)
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))  # an opaque leaf: its identity (baked into the graph)
    return x


class GraphStep:
    """Captured micro-batch steps of one model, replayed at the step seam."""

    def __init__(self, config: GraphConfig | None = None, facts: dict | None = None) -> None:
        self.config = config if config is not None else GraphConfig()
        #: what the passes may read (e.g. the data-parallel mesh)
        self.facts = dict(facts or {})
        #: graphs captured so far (a changed shape or state structure adds one)
        self.captures = 0
        #: the passes that rewrote the captured graphs, in order, and whether any may change numerics
        self.passes = [p.name for p in selected_passes(list(self.config.enable), list(self.config.disable))]
        self.changes_numerics = any(p.changes_numerics for p in
                                    selected_passes(list(self.config.enable), list(self.config.disable)))
        #: the last capture's per-pass records
        self.records: dict[str, dict] = {}
        #: ``graph.check_steps``: per checked micro-batch, the first diverging node (None: bitwise equal)
        self.checks: list = []
        self._cache: collections.OrderedDict[Any, CapturedStep] = collections.OrderedDict()
        self._objectives: dict[int, Any] = {}  # keyed objectives, kept alive (their id is in the key)
        self._default: Any = None

    def default_objective(self, factory: Callable[[], Any]) -> Any:
        """One instance of the default objective (a new one per micro-batch would re-capture)."""
        if self._default is None:
            self._default = factory()
        return self._default

    def key(self, model: nn.Module, objective: Any, batch_leaves: list, spec: Any, accumulate: int,
            autocast_key: Any) -> tuple:
        self._objectives.setdefault(id(objective), objective)
        params = tuple((id(p), p.requires_grad) for p in model.parameters())
        return (str(spec), tuple(_leaf_key(x) for x in batch_leaves), state_signature(model), accumulate,
                autocast_key, model.training, id(objective), params)

    def step(self, model: nn.Module, objective: Callable, batch: Any, accumulate: int,
             autocast: Callable[[], contextlib.AbstractContextManager], autocast_key: Any = None):
        """One micro-batch: capture on a new key, replay, accumulate the gradients into ``.grad``;
        returns the objective's report."""
        leaves, spec = pytree.tree_flatten(batch)
        key = self.key(model, objective, leaves, spec, accumulate, autocast_key)
        captured = self._cache.get(key)
        if captured is None:
            captured = self._capture(model, objective, batch, accumulate, autocast)
            self._cache[key] = captured
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if len(self.checks) < self.config.check_steps:
            self._check(captured, model, objective, batch, leaves, accumulate, autocast)
        report, grads = captured.run(leaves)
        accumulate_grads(captured.trainable_params(), grads)
        return report

    def _check(self, captured: CapturedStep, model: nn.Module, objective: Callable, batch: Any, leaves: list,
               accumulate: int, autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Run the micro-batch eagerly beside the graph (``lockstep.graph.debug``) and log where they
        first differ; the module state the eager run changes is put back before the replay."""
        from lockstep.graph.debug import first_divergence

        inputs = captured.inputs(leaves)
        saved = captured.state.snapshot()
        try:
            found = first_divergence(model, objective, batch, captured.gm, inputs, autocast=autocast,
                                     accumulate=accumulate)
        finally:
            captured.state.restore(saved)
        self.checks.append(found)
        if found is None:
            log.info("graph check %d/%d: graph == eager (every node)", len(self.checks), self.config.check_steps)
        else:
            log.warning("graph check %d/%d: %s", len(self.checks), self.config.check_steps, found)

    def _capture(self, model: nn.Module, objective: Callable, batch: Any, accumulate: int,
                 autocast: Callable[[], contextlib.AbstractContextManager]) -> CapturedStep:
        captured, _ = capture_step(model, objective, batch, accumulate=accumulate, autocast=autocast)
        ctx = PassContext(self.config, facts={**self.facts, "param_names": captured.param_names})
        captured.gm = run_passes(captured.gm, ctx)
        self.records = ctx.records
        self.captures += 1
        shapes = [tuple(x.shape) for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
        log.info("graph: captured step #%d (batch shapes %s, accumulate %d, %d nodes, passes %s)",
                 self.captures, shapes, accumulate, len(captured.gm.graph.nodes), self.passes)
        return captured


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """The pass pipeline (``lockstep.graph.passes.pipeline``)."""
    from lockstep.graph.passes.pipeline import run_passes as pipeline

    return pipeline(gm, ctx, getattr(ctx.config, "dump_dir", ""))


@torch.no_grad()
def accumulate_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Write a replay's gradients as autograd's AccumulateGrad does: a parameter without ``.grad`` gets
    the gradient (in the parameter's layout, never aliasing another), one with ``.grad`` adds it in place."""
    seen: set[int] = set()
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is not None:
            p.grad.add_(g)
            continue
        local = g._local_tensor if hasattr(g, "_local_tensor") else g
        ptr = local.untyped_storage().data_ptr()
        if ptr in seen or local._base is not None or g.stride() != p.stride():
            g = torch.empty_like(p).copy_(g)
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            ptr = local.untyped_storage().data_ptr()
        seen.add(ptr)
        p.grad = g


def graph_manifest(runtime: Any) -> dict:
    """The manifest's ``graph`` section: the training mode, and in graph mode the passes that rewrite
    the captured step and whether any of them may change numerics (then the run is not bitwise eager)."""
    graph = getattr(runtime, "graph", None)
    if graph is None:
        return {"training_mode": "eager"}
    return {"training_mode": "graph", "passes": list(graph.passes), "changes_numerics": graph.changes_numerics}
