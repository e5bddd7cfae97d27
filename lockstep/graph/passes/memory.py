"""The ``memory`` pass: the activation memory policy, deciding which saved activations the backward
recomputes instead of the forward keeping them alive (the ``recompute`` pass then places the copies).

What the forward keeps for the backward are its nodes that backward ops use; they are grouped by the
storage they hold (a saved view holds its base), one group per storage. Dropping a group means every
saved node of it is recomputed in the backward from what stays kept (graph inputs and kept groups),
through the chain of forward ops in between.

- Default (``graph.memory_budget = 0``): drop a group when its chain is only cheap ops (elementwise,
  casts, views, the reductions of norms; at most ``_CHEAP_CHAIN`` of them) reading kept tensors: saved
  bytes drop and no matmul or attention is recomputed.
- Budget ``f`` in (0, 1]: keep a set of groups of at most ``f`` x the original saved bytes, maximising the
  recompute cost (estimated FLOPs) of what is kept, a 0/1 knapsack over the groups' bytes.

A chain with a random draw is never recomputed (it would draw other numbers), nor one with a collective
or an in-place op: such groups stay kept, counted in the record ("refused"). Recomputing deterministic
ops on the same inputs yields the same bits, so the policy keeps the graph bitwise equal to eager.

Marks ``node.meta["lockstep_recompute"] = True`` on every node to recompute (saved nodes of dropped groups and
their chains). Record: saved bytes before and planned after, groups dropped/kept/refused.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch
import torch.fx

from lockstep.graph.passes import GraphPass, PassContext, analysis, register_pass

#: the longest chain of cheap ops the default policy recomputes for one saved tensor
_CHEAP_CHAIN = 8
_CHEAP_REDUCTIONS = {"sum", "mean", "amax", "amin", "var", "var_mean", "_to_copy", "clone", "to", "expand_copy"}
#: resolution of the knapsack over bytes (the budget is met exactly: weights are rounded up)
_KNAPSACK_UNITS = 4096


def _is_cheap(node: torch.fx.Node) -> bool:
    if analysis.is_view(node) or node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or analysis.is_expensive(node):
        return False
    return torch.Tag.pointwise in target.tags or target._schema.name.split("::")[-1] in _CHEAP_REDUCTIONS


def _refusal(node: torch.fx.Node, needed: set[torch.fx.Node]) -> str:
    """Why ``node`` may not be recomputed as part of the chain ``needed`` ("" when it may). An in-place
    op may, when what it writes is recomputed in the same chain (``x.mean(...).add_(eps)``): the copy
    then writes into a copy."""
    if node.op != "call_function" or analysis.phase(node) != "forward":
        return "not a forward op"
    if analysis.is_rng(node):
        return "rng"
    if analysis.is_collective(node):
        return "collective"
    written = analysis.written_args(node)
    if written and all(w in needed for w in written):
        return ""
    if analysis.is_impure(node):
        return "side effect"
    return ""


def chain(node: torch.fx.Node, available: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The forward ops to rerun to get ``node`` back from ``available`` tensors, inputs first."""
    order: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()

    def visit(n: torch.fx.Node) -> None:
        if n in seen or n in available or n.op in ("placeholder", "get_attr"):
            return
        seen.add(n)
        for i in n.all_input_nodes:
            visit(i)
        order.append(n)

    visit(node)
    return order


def _groups(saved: list[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Storage root -> the saved nodes holding it, roots in graph order (inputs' storages left out)."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in saved:
        root = analysis.storage_root(node)
        if root.op not in ("placeholder", "get_attr"):
            groups.setdefault(root, []).append(node)
    return groups


def _group_chain(members: list[torch.fx.Node], available: set[torch.fx.Node]) -> list[torch.fx.Node]:
    out: dict[torch.fx.Node, None] = {}
    for member in members:
        out.update(dict.fromkeys(chain(member, available)))
    return list(out)


def _knapsack(weights: list[int], values: list[float], capacity: int) -> list[bool]:
    """0/1 knapsack: which items to keep (total weight <= capacity) for the largest total value."""
    if sum(weights) <= capacity:
        return [True] * len(weights)
    if capacity <= 0:
        return [w == 0 for w in weights]
    unit = max(1, math.ceil(sum(weights) / _KNAPSACK_UNITS))
    sizes = [math.ceil(w / unit) for w in weights]
    cap = capacity // unit
    best = np.zeros(cap + 1)
    took = np.zeros((len(sizes), cap + 1), dtype=bool)
    for i, (size, value) in enumerate(zip(sizes, values)):
        if size > cap:
            continue
        candidate = best[:cap + 1 - size] + value
        better = candidate > best[size:]
        took[i, size:] = better
        best[size:] = np.where(better, candidate, best[size:])
    keep, room = [False] * len(sizes), cap
    for i in reversed(range(len(sizes))):
        if took[i, room]:
            keep[i], room = True, room - sizes[i]
    return keep


def plan(graph: torch.fx.Graph, budget: float) -> tuple[dict[torch.fx.Node, list[torch.fx.Node]], dict]:
    """Dropped groups (root -> the nodes to recompute for it) and the record."""
    saved = analysis.saved_nodes(graph)
    groups = _groups(saved)
    inputs = {n for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    everything = inputs | set(saved)
    refused: dict[str, int] = {}
    droppable: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for root, members in groups.items():
        needed = _group_chain(members, everything - set(members))
        reasons = {r for r in (_refusal(n, set(needed)) for n in needed) if r}
        if reasons:
            for reason in reasons:
                refused[reason] = refused.get(reason, 0) + 1
        else:
            droppable[root] = needed
    sizes = {root: analysis.node_bytes(root) for root in groups}
    before = sum(sizes.values())
    if budget <= 0:
        dropped_roots, available = [], set(everything)
        for root, members in groups.items():
            if root not in droppable:
                continue
            needed = _group_chain(members, available - set(members))
            if len(needed) <= _CHEAP_CHAIN and all(map(_is_cheap, needed)):
                dropped_roots.append(root)
                available -= set(members)
    else:
        candidates = list(droppable)
        fixed = sum(sizes[r] for r in groups if r not in droppable)
        costs = [sum(map(analysis.flops, droppable[r])) + 1.0 for r in candidates]
        keep = _knapsack([sizes[r] for r in candidates], costs, math.floor(budget * before) - fixed)
        dropped_roots = [r for r, k in zip(candidates, keep) if not k]
    dropped_members = {m for r in dropped_roots for m in groups[r]}
    available = everything - dropped_members
    plan_out = {root: _group_chain(groups[root], available) for root in dropped_roots}
    after = before - sum(sizes[r] for r in dropped_roots)
    record = {"saved_bytes_before": before, "saved_bytes_after": after, "groups": len(groups),
              "groups_recomputed": len(dropped_roots), "refused": refused, "budget": budget,
              "budget_met": budget <= 0 or after <= budget * before,
              "recompute_flops": sum(analysis.flops(n) for n in {n for c in plan_out.values() for n in c})}
    return plan_out, record


def memory(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    budget = float(getattr(ctx.config, "memory_budget", 0.0))
    dropped, record = plan(gm.graph, budget)
    for node in gm.graph.nodes:
        node.meta.pop("lockstep_recompute", None)
    for nodes in dropped.values():
        for node in nodes:
            node.meta["lockstep_recompute"] = True
    ctx.records.setdefault("memory", {}).update(record)
    return gm


register_pass(GraphPass("memory", memory, changes_numerics=False, default=True,
                        doc="activation policy: which saved tensors the backward recomputes (graph.memory_budget)"))
