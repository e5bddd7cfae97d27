"""The ``recompute`` pass: place the recomputation the ``memory`` pass decided.

Every backward use of a forward node marked ``meta["lockstep_recompute"]`` is rewired to a copy of it made just
before the first backward op that needs it, together with the marked nodes it reads (inputs first); a
copy serves every later backward use. The forward originals that only the backward used then die (dead
code elimination, keeping side effects), so the forward no longer keeps their storage alive.

Copies carry ``meta["phase"] = "backward"``, the original's module path, and
``meta["recomputed_from"]`` (the original node's name). Record: ``recomputed`` (original -> the backward
node its copy was placed before), ``saved_bytes_after`` (measured on the rewritten graph), and the peak
of intermediate bytes alive at once before/after (``analysis.peak_bytes``: a static estimate in node order).
"""

from __future__ import annotations

import torch.fx

from lockstep.graph.passes import GraphPass, PassContext, analysis, register_pass


def _marked(node: torch.fx.Node) -> bool:
    return bool(node.meta.get("lockstep_recompute")) and analysis.phase(node) == "forward"


def _closure(node: torch.fx.Node, copies: dict[torch.fx.Node, torch.fx.Node]) -> list[torch.fx.Node]:
    """The marked nodes not yet copied that a copy of ``node`` needs: its marked inputs, recursively,
    and the in-place ops writing into any of them (a copy must be read after the same writes)."""
    found: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in found or n in copies or not _marked(n):
            continue
        found.add(n)
        todo.extend(n.all_input_nodes)
        todo.extend(u for u in n.users if n in analysis.written_args(u))
    return list(found)


def recompute(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    peak_before = analysis.peak_bytes(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    placed: dict[str, str] = {}

    def copy_of(node: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        # copied in the original order, so reads and in-place writes keep their sequence
        for original in sorted(_closure(node, copies), key=position.__getitem__):
            with graph.inserting_before(before):
                new = graph.node_copy(original, lambda n: copies.get(n, n))
            new.meta = {**original.meta, "phase": "backward", "recomputed_from": original.name}
            new.meta.pop("lockstep_recompute", None)
            copies[original] = new
            placed[original.name] = before.name
        return copies[node]

    for user in list(graph.nodes):
        if user.op != "call_function" or analysis.phase(user) != "backward" or "recomputed_from" in user.meta:
            continue
        for source in user.all_input_nodes:
            if _marked(source):
                user.replace_input_with(source, copy_of(source, user))
    for node in graph.nodes:
        node.meta.pop("lockstep_recompute", None)
    graph.eliminate_dead_code(is_impure_node=analysis.is_impure)
    ctx.records.setdefault("recompute", {}).update(
        recomputed=placed, nodes_recomputed=len(placed), saved_bytes_after=analysis.saved_bytes(graph),
        peak_bytes_before=peak_before, peak_bytes_after=analysis.peak_bytes(graph))
    return gm


register_pass(GraphPass("recompute", recompute, changes_numerics=False, default=True,
                        doc="recomputation placed just before the first backward use"))
