"""Reshard after forward in a captured step: the backward gathers the parameters again.

A captured step keeps each gathered (full) parameter alive from its forward use to its backward use
(the matmul's backward needs the weight): the whole unsharded model is held through the backward,
which FSDP exists to avoid. This pass does what FSDP2's ``reshard_after_forward`` does: for each
forward all-gather of the traceable FSDP (:mod:`lockstep.graph.simple_fsdp`) whose value a backward op
uses, it copies the gather (its inputs' casts/views of the shard, the collective, its wait and the
views/casts of the full parameter) into the backward, just before the first backward use, with the
collective itself issued one unit earlier (prefetch in backward order); backward ops then read the
copy and the forward's full parameter dies after its last forward use.

The copy gathers the same shards, so it computes the same bits (no numerics change). The policy is
``parallel.reshard_after_forward`` (``ctx.facts["reshard_after_forward"]``, default "always" as in
FSDP2): "always" regathers every unit, "except_last" every block but the last (not the root, which
the backward uses first), "never" none. Records the units regathered and the bytes saved for backward
before and after.
"""

from __future__ import annotations

import re

import torch
import torch.fx

from lockstep.graph.passes import GraphPass, PassContext, register_pass
from lockstep.graph.passes.analysis import phase, saved_bytes
from lockstep.graph.passes.bucketing import (ancestors, collective_kind, first_compute_by_unit, fsdp_unit, layout_chain,
                                             parameter_only, stable_topological_sort, wait_of)

_BLOCK = re.compile(r"^layers\.(\d+)$")


def _units_to_reshard(units: list[str], policy: str) -> set[str]:
    if policy == "never":
        return set()
    if policy == "always":
        return set(units)
    blocks = sorted((u for u in units if _BLOCK.match(u)), key=lambda u: int(_BLOCK.match(u).group(1)))
    return set(blocks[:-1])  # except_last: the root and the last block keep their gathered parameters


def _erase_dead(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase those of ``nodes`` nothing uses, last first (a collective's dead copy included)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(nodes, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)


def _regather(graph: torch.fx.Graph, start: torch.fx.Node, anchor: torch.fx.Node | None) -> bool:
    """Copy ``start``'s gather for its backward users; the collective before ``anchor`` when earlier."""
    wait = wait_of(start)
    members = [wait, *layout_chain(wait)]
    inside = set(members)
    backward_users = {u for m in members for u in m.users if u not in inside and phase(u) == "backward"}
    if not backward_users:
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(backward_users, key=order.__getitem__)
    issue = [*ancestors(start.args[0]), start]
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(first):
        for n in [*issue, *sorted(members, key=order.__getitem__)]:
            new = graph.node_copy(n, lambda a: copies.get(a, a))
            new.meta = {**n.meta, "phase": "backward"}
            copies[n] = new
    for m in members:
        for user in list(m.users):
            if user in backward_users:
                user.replace_input_with(m, copies[m])
    if anchor is not None and order[anchor] < order[first]:
        for n in (copies[i] for i in issue):
            anchor.prepend(n)
    _erase_dead(graph, [*copies.values(), *members[1:]])
    return True


def reshard_after_forward(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    policy = str(ctx.facts.get("reshard_after_forward", "always"))
    memo: dict = {}
    starts = [n for n in graph.nodes if collective_kind(n) == "all_gather" and phase(n) == "forward"
              and wait_of(n) is not None and parameter_only(n.args[0], memo)]
    chosen = _units_to_reshard(list(dict.fromkeys(fsdp_unit(n) for n in starts)), policy)
    before = saved_bytes(graph)
    # backward units in the order their compute starts: a unit's regather is issued at the previous one's
    first_compute = first_compute_by_unit(graph, "backward")
    backward_units = list(first_compute)
    regathered = []
    for start in starts:
        unit = fsdp_unit(start)
        if unit not in chosen:
            continue
        position = backward_units.index(unit) if unit in backward_units else 0
        anchor = first_compute[backward_units[position - 1]] if position > 0 else None
        if _regather(graph, start, anchor):
            regathered.append(unit)
    if regathered:
        stable_topological_sort(graph)
        graph.lint()
        gm.recompile()
    ctx.records["reshard_after_forward"] = {"policy": policy, "regathered": regathered,
                                            "saved_bytes": {"before": before, "after": saved_bytes(graph)}}
    return gm


register_pass(GraphPass("reshard_after_forward", reshard_after_forward, changes_numerics=False, default=True,
                        doc="gather parameters again in backward instead of keeping them (FSDP's reshard)"))
