"""Passes over the traceable FSDP's collectives (:mod:`lockstep.graph.simple_fsdp`): bucketing and overlap.

``bucket_collectives``: the per-parameter collectives of one FSDP unit (a block "layers.N", or the root:
embeddings, final norm, head -- FSDP2's units) become one collective over a flat buffer: forward
all-gathers (inputs flattened and concatenated, gathered, each parameter's [shards, numel] columns cut
back out), backward reduce-scatters (each gradient viewed [shards, numel / shards] and concatenated on
dim 1, so every rank's shard stays contiguous) and HSDP's all-reduces. Numerics: a gather copies bits;
a reduction sums each element over the same ranks, and the backends reduce element by element (gloo:
the same order for every position of a buffer), so gradients stay bitwise equal (tested at world 2
and 4).

``reorder_collectives``: each forward all-gather is issued before the compute of the unit before its
own (prefetch one unit ahead; the gather's inputs depend on parameters only), every wait moves down to
just before the first op that needs its value (the views of a gradient bound for the graph's output
follow it), and reduce-scatters are issued as soon as their inputs exist. Functional collectives are
asynchronous until their ``wait_tensor``, so compute between the two overlaps the communication; the
order is deterministic, the same on every rank. Only positions change, never values.

Both are default passes and no-ops in a graph without functional collectives; each records its counts
in ``ctx.records[name]``.
"""

from __future__ import annotations

import heapq
import re

import torch
import torch.fx

from lockstep.graph.passes import GraphPass, PassContext, register_pass
from lockstep.graph.passes.analysis import is_collective, is_rng, module_path, phase, written_args

_OPS = torch.ops._c10d_functional
_UNIT = re.compile(r"^(layers\.\d+|mtp\.\d+)(\.|$)")
_KINDS = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
          "all_reduce": "all_reduce"}


def _is(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and getattr(node.target, "_overloadpacket", None) is getattr(_OPS, name, 0)


def collective_kind(node: torch.fx.Node) -> str | None:
    """"all_gather" / "reduce_scatter" / "all_reduce" for a functional collective's start node."""
    for kind, name in _KINDS.items():
        if _is(node, name):
            return kind
    return None


def is_wait(node: torch.fx.Node) -> bool:
    return _is(node, "wait_tensor")


def count_collectives(graph: torch.fx.Graph) -> dict[str, int]:
    """Functional collectives per kind in ``graph`` (what one replay issues)."""
    counts = {kind: 0 for kind in _KINDS}
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            counts[kind] += 1
    return counts


def fsdp_unit(node: torch.fx.Node) -> str:
    """The FSDP unit of a node: its block ("layers.N", "mtp.N") or "root"."""
    match = _UNIT.match(module_path(node))
    return match.group(1) if match else "root"


def wait_of(start: torch.fx.Node) -> torch.fx.Node | None:
    users = list(start.users)
    return users[0] if len(users) == 1 and is_wait(users[0]) else None


def _is_pure(node: torch.fx.Node) -> bool:
    """A call_function a rewrite may move: no mutation, no collective, no random draw."""
    target = node.target
    if node.op != "call_function" or is_collective(node) or is_rng(node):
        return False
    return not (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable)


def parameter_only(node: torch.fx.Node, memo: dict) -> bool:
    """True when ``node`` is computed from graph inputs alone by pure ops (a gather's cast/pad/views)."""
    if node in memo:
        return memo[node]
    if node.op == "placeholder":  # an input written in place is not safe to read early
        memo[node] = not any(node in written_args(u) for u in node.users)
        return memo[node]
    memo[node] = _is_pure(node) and all(parameter_only(a, memo) for a in node.all_input_nodes)
    return memo[node]


def ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s non-placeholder ancestors (itself included) in graph order."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _move_before(nodes: list[torch.fx.Node], anchor: torch.fx.Node) -> int:
    """Move ``nodes`` (in order) to just before ``anchor`` when they are after it; returns how many moved."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    moved = 0
    for n in nodes:
        if order[n] > order[anchor]:
            anchor.prepend(n)
            moved += 1
    return moved


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder so every node follows its inputs, keeping the current order wherever it already does."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for a in set(n.all_input_nodes):
            users[a].append(n)
    ready = [index[n] for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    result = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        result.append(n)
        for u in users[n]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, index[u])
    if len(result) != len(nodes):
        raise RuntimeError("graph pass produced a cycle")
    if result == nodes:
        return
    anchor = nodes[-1]  # the output node stays last
    for n in result[:-1]:
        anchor.prepend(n)


# ------------------------------------------------------------------ bucketing

def _meta(node: torch.fx.Node, shape, dtype, like: torch.fx.Node) -> torch.fx.Node:
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    node.meta["module_path"] = fsdp_unit(like) if fsdp_unit(like) != "root" else module_path(like)
    node.meta["phase"] = phase(like)
    return node


def _call(graph: torch.fx.Graph, target, args, shape, dtype, like) -> torch.fx.Node:
    return _meta(graph.call_function(target, args), shape, dtype, like)


def _val(node: torch.fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _bucket_all_gather(graph: torch.fx.Graph, starts: list[torch.fx.Node], memo: dict) -> None:
    first = starts[0]
    _, size, group = first.args
    inputs = [s.args[0] for s in starts]
    for x in inputs:
        _move_before(ancestors(x), first)
    dtype = _val(inputs[0]).dtype
    numels = [_val(x).numel() for x in inputs]
    total = sum(numels)
    with graph.inserting_before(first):
        flat = [_call(graph, torch.ops.aten.view.default, (x, [-1]), (n,), dtype, s)
                for x, n, s in zip(inputs, numels, starts)]
        cat = _call(graph, torch.ops.aten.cat.default, (flat, 0), (total,), dtype, first)
        gathered = _call(graph, _OPS.all_gather_into_tensor.default, (cat, size, group), (size * total,), dtype, first)
        wait = _call(graph, _OPS.wait_tensor.default, (gathered,), (size * total,), dtype, first)
        rows = _call(graph, torch.ops.aten.view.default, (wait, [size, total]), (size, total), dtype, first)
        offset = 0
        for start, n in zip(starts, numels):
            old_wait = wait_of(start)
            shape = tuple(_val(old_wait).shape)
            part = _call(graph, torch.ops.aten.slice.Tensor, (rows, 1, offset, offset + n), (size, n), dtype, start)
            dense = _call(graph, torch.ops.aten.clone.default, (part,), (size, n), dtype, start)
            dense.kwargs = {"memory_format": torch.contiguous_format}
            out = _call(graph, torch.ops.aten.view.default, (dense, list(shape)), shape, dtype, start)
            old_wait.replace_all_uses_with(out)
            offset += n
    for start in starts:
        graph.erase_node(wait_of(start))
        graph.erase_node(start)


def _bucket_reduce(graph: torch.fx.Graph, starts: list[torch.fx.Node], kind: str) -> None:
    last = starts[-1]
    group = last.args[-1]
    inputs = [s.args[0] for s in starts]
    dtype = _val(inputs[0]).dtype
    size = last.args[2] if kind == "reduce_scatter" else 1
    cols = [_val(x).numel() // size for x in inputs]
    total = sum(cols)
    with graph.inserting_before(last):
        parts = [_call(graph, torch.ops.aten.view.default, (x, [size, c]), (size, c), dtype, s)
                 for x, c, s in zip(inputs, cols, starts)]
        cat = _call(graph, torch.ops.aten.cat.default, (parts, 1), (size, total), dtype, last)
        flat = _call(graph, torch.ops.aten.view.default, (cat, [-1]), (size * total,), dtype, last)
        if kind == "reduce_scatter":
            args = (flat, last.args[1], size, group)
            reduced = _call(graph, _OPS.reduce_scatter_tensor.default, args, (total,), dtype, last)
        else:
            reduced = _call(graph, _OPS.all_reduce.default, (flat, last.args[1], group), (total,), dtype, last)
        wait = _call(graph, _OPS.wait_tensor.default, (reduced,), (total,), dtype, last)
        offset = 0
        for start, c in zip(starts, cols):
            old_wait = wait_of(start)
            shape = tuple(_val(old_wait).shape)
            part = _call(graph, torch.ops.aten.slice.Tensor, (wait, 0, offset, offset + c), (c,), dtype, start)
            out = _call(graph, torch.ops.aten.view.default, (part, list(shape)), shape, dtype, start)
            old_wait.replace_all_uses_with(out)
            offset += c
    for start in starts:
        graph.erase_node(wait_of(start))
        graph.erase_node(start)


def _bucket_key(node: torch.fx.Node, kind: str) -> tuple:
    # same unit, phase, collective, group and reduce op; one dtype per flat buffer
    return (fsdp_unit(node), phase(node), kind, node.args[-1], tuple(node.args[1:-1]), _val(node.args[0]).dtype)


def bucket_collectives(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    before = count_collectives(graph)
    memo: dict = {}
    buckets: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is None or wait_of(node) is None or "val" not in node.args[0].meta:
            continue
        if kind == "all_gather" and not parameter_only(node.args[0], memo):
            continue  # only a gather of parameters can move up to its unit's first gather
        buckets.setdefault(_bucket_key(node, kind), []).append(node)
    merged = 0
    for key, starts in buckets.items():
        if len(starts) < 2:
            continue
        if key[2] == "all_gather":
            _bucket_all_gather(graph, starts, memo)
        else:
            _bucket_reduce(graph, starts, key[2])
        merged += 1
    if merged:
        stable_topological_sort(graph)
        graph.lint()
        gm.recompile()
    ctx.records["bucket_collectives"] = {"before": before, "after": count_collectives(graph), "buckets": merged}
    return gm


# ------------------------------------------------------------------ reordering

def first_compute_by_unit(graph: torch.fx.Graph, which: str) -> dict[str, torch.fx.Node]:
    """Each FSDP unit's first compute node of phase ``which``, units in the order their compute starts."""
    first: dict[str, torch.fx.Node] = {}
    compute = compute_nodes(graph)
    for n in graph.nodes:
        if n in compute and phase(n) == which:
            first.setdefault(fsdp_unit(n), n)
    return first


def compute_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The ops that compute (what communication can overlap): not collectives, their waits and the
    views/slices/casts of a wait's value, nor what is computed from graph inputs alone."""
    memo: dict = {}
    plumbing: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if is_wait(node):
            plumbing.update((node, *layout_chain(node)))
    return {n for n in graph.nodes if n.op == "call_function" and collective_kind(n) is None
            and n not in plumbing and not parameter_only(n, memo)}


def _overlap(graph: torch.fx.Graph) -> int:
    """Compute nodes between each collective's start and its wait, summed: what may overlap it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    is_compute = compute_nodes(graph)
    compute = [0]
    for n in graph.nodes:
        compute.append(compute[-1] + (1 if n in is_compute else 0))
    total = 0
    for n in graph.nodes:
        wait = wait_of(n) if collective_kind(n) else None
        if wait is not None:
            total += compute[order[wait]] - compute[order[n] + 1]
    return total


def layout_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The pure single-input ops after ``node`` (its users, theirs, ...): views, slices, casts of its
    value. They move down with its wait; the first op outside them is what really needs the value."""
    chain: list[torch.fx.Node] = []
    frontier = [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in chain and _is_pure(u) and len(u.all_input_nodes) == 1:
                chain.append(u)
                frontier.append(u)
    return chain


def _first_real_user(node: torch.fx.Node, chain: list[torch.fx.Node]) -> torch.fx.Node:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    members = {node, *chain}
    users = [u for m in members for u in m.users if u not in members]
    return min(users, key=order.__getitem__)


def reorder_collectives(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    overlap_before = _overlap(graph)
    memo: dict = {}
    first_compute = first_compute_by_unit(graph, "forward")
    units = list(first_compute)
    prefetched = 0
    for start in [n for n in graph.nodes if collective_kind(n) == "all_gather"]:
        unit = fsdp_unit(start)
        if phase(start) != "forward" or unit not in first_compute or not parameter_only(start.args[0], memo):
            continue
        position = units.index(unit)
        anchor = first_compute[units[max(position - 1, 0)]]
        if _move_before([*ancestors(start.args[0]), start], anchor):
            prefetched += 1
    # reductions: issued right after their input exists
    issued_early = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for start in [n for n in graph.nodes if collective_kind(n) in ("reduce_scatter", "all_reduce")]:
        source = max(start.all_input_nodes, key=order.__getitem__)
        if source.next is not start:
            source.append(start)
            issued_early += 1
    # waits: just before the first op that needs the value
    moved_waits = 0
    for wait in [n for n in graph.nodes if is_wait(n)]:
        chain = layout_chain(wait)
        target = _first_real_user(wait, chain)
        order = {n: i for i, n in enumerate(graph.nodes)}
        members = sorted([wait, *chain], key=order.__getitem__)
        if order[target] - order[wait] == len(members):
            continue  # already right before the first op that needs it
        for n in members:
            target.prepend(n)
        moved_waits += 1
    stable_topological_sort(graph)
    graph.lint()
    gm.recompile()
    ctx.records["reorder_collectives"] = {"prefetched_all_gathers": prefetched, "reductions_issued_early": issued_early,
                                          "moved_waits": moved_waits,
                                          "overlapped_compute_nodes": {"before": overlap_before,
                                                                       "after": _overlap(graph)}}
    return gm


register_pass(GraphPass("bucket_collectives", bucket_collectives, changes_numerics=False, default=True,
                        doc="merge each FSDP unit's all-gathers / reduce-scatters into one collective per unit"))
register_pass(GraphPass("reorder_collectives", reorder_collectives, changes_numerics=False, default=True,
                        doc="prefetch all-gathers one unit ahead, issue reductions early, wait late (overlap)"))
