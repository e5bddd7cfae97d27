"""Run the selected passes over a captured step, in registry order, checking the graph after each.

Each pass's own record (``ctx.records[name]``: nodes removed/moved/recomputed, bytes) gets the node
counts before and after added; with ``dump_dir`` the graph is written before the first pass
(``00_captured``) and after each one (``lockstep.graph.dump``). This module registers no pass.
"""

from __future__ import annotations

import time

import torch.fx

from lockstep.graph.dump import dump_graph
from lockstep.graph.passes import PassContext, selected_passes


def _count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, dump_dir: str = "") -> torch.fx.GraphModule:
    """Apply ``selected_passes(ctx.config.enable, ctx.config.disable)`` to ``gm`` and return the result.

    ``dump_dir`` defaults to ``ctx.config.dump_dir``. A pass that leaves a malformed graph fails here,
    naming the pass, rather than at the first step.
    """
    dump_dir = dump_dir or getattr(ctx.config, "dump_dir", "")
    passes = selected_passes(list(ctx.config.enable), list(ctx.config.disable))
    if dump_dir:
        dump_graph(gm, dump_dir, 0, "captured")
    for index, graph_pass in enumerate(passes, start=1):
        before = _count(gm)
        start = time.perf_counter()
        gm = graph_pass.fn(gm, ctx)
        try:
            gm.graph.lint()
        except Exception as err:  # lint raises RuntimeError/AssertionError: name the culprit
            raise RuntimeError(f"graph pass {graph_pass.name!r} left a malformed graph: {err}") from err
        gm.recompile()
        record = ctx.records.setdefault(graph_pass.name, {})
        record.update(nodes_before=before, nodes_after=_count(gm),
                      seconds=round(time.perf_counter() - start, 3),
                      changes_numerics=graph_pass.changes_numerics)
        if dump_dir:
            dump_graph(gm, dump_dir, index, graph_pass.name, record)
    return gm
