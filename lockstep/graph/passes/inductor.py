"""The opt-in ``inductor`` pass (``graph.enable = ["inductor"]``): compile the captured step, or only its
nodes in tagged regions, with Inductor. Numerics change (fused kernels, other reduction orders), so the
pass is flagged and never runs by default.

``graph.inductor_regions`` (module-path globs matched with ``match_module_globs``; backward nodes carry
their forward op's path) picks the nodes; empty = every op of the graph. The picked nodes are grouped
into connected partitions (``CapabilityBasedPartitioner``: no partition depends on itself through an
uncompiled node), each fused into a submodule compiled by ``torch._inductor.compile_fx.compile_fx`` for
the shapes/strides/dtypes the capture recorded. The result is a GraphModule that calls the compiled
kernels; compilation happens here, once per capture. Record: partitions, nodes compiled, seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.fx

from lockstep.config.overrides import match_module_globs
from lockstep.graph.passes import GraphPass, PassContext, analysis, register_pass


def _compile_fx() -> Callable:
    try:
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner  # noqa: F401 (feature check)
    except ImportError as err:
        raise RuntimeError(f"graph pass 'inductor' needs torch._inductor.compile_fx.compile_fx and "
                           f"torch.fx.passes.infra.partitioner, which torch {torch.__version__} lacks "
                           f"({err}); drop 'inductor' from graph.enable") from err
    return compile_fx


class _Compiled(torch.nn.Module):
    """A compiled partition, called like the submodule it replaces."""

    def __init__(self, fn: Callable, returns_tuple: bool) -> None:
        super().__init__()
        self.fn, self.returns_tuple = fn, returns_tuple

    def forward(self, *args: torch.Tensor):
        out = self.fn(*args)
        return tuple(out) if self.returns_tuple else out[0]


def _example(val: object) -> object:
    """A real tensor with the recorded shape/strides/dtype (the capture's values are fake tensors)."""
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).zero_()
    return val


def _selected(gm: torch.fx.GraphModule, regions: list[str]) -> set[torch.fx.Node]:
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    if not regions:
        return set(ops)
    paths = {analysis.module_path(n) for n in ops} - {""}
    matched = match_module_globs(sorted(paths), regions, "graph.inductor_regions")
    chosen = {p for hits in matched.values() for p in hits}
    return {n for n in ops if analysis.module_path(n) in chosen}


def inductor(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    compile_fx = _compile_fx()
    start = time.perf_counter()
    chosen = _selected(gm, list(getattr(ctx.config, "inductor_regions", [])))

    class _Chosen(OperatorSupportBase):
        def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
            # collectives stay outside the compiled kernels: their order is the bucketing passes' work
            return node in chosen and not analysis.is_collective(node)

    partitioner = CapabilityBasedPartitioner(gm, _Chosen(), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    fused = partitioner.fuse_partitions(partitions)
    compiled_nodes = 0
    for node in list(fused.graph.nodes):
        if node.op != "call_module":
            continue
        sub = fused.get_submodule(node.target)
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        compiled_nodes += sum(1 for n in sub.graph.nodes if n.op == "call_function")
        output = next(n for n in sub.graph.nodes if n.op == "output")
        returns_tuple = isinstance(output.args[0], (tuple, list))
        if not returns_tuple:  # compile_fx returns a list; keep the submodule's calling convention
            output.args = ((output.args[0],),)
            sub.recompile()
        examples = [_example(a.meta.get("val")) for a in node.args]
        with torch.no_grad():
            fn = compile_fx(sub, examples)
        setattr(fused, node.target, _Compiled(fn, returns_tuple))
    fused.recompile()
    ctx.records.setdefault("inductor", {}).update(
        partitions=len(partitions), nodes_compiled=compiled_nodes,
        regions=list(getattr(ctx.config, "inductor_regions", [])) or ["(whole graph)"],
        compile_seconds=round(time.perf_counter() - start, 3))
    return fused


register_pass(GraphPass("inductor", inductor, changes_numerics=True, default=False,
                        doc="Inductor over the whole graph or graph.inductor_regions (changes numerics)"))
