"""The ``cleanup`` pass: drop what computes nothing, without changing a bit of the result.

Removed: no-op aliases (``detach``/``alias``: the captured step runs without autograd, so a detach only
renames its input), views and expands to the input's own shape and strides, and copies (``clone``,
``_to_copy`` to the same dtype/device/layout/strides) whose input and result nobody writes to. Then dead
code, keeping every node with a side effect: in-place ops, collectives (all ranks run the same graph, but
a collective is never the place to save a node) and random draws (dropping one would shift the
generator for every later draw).

Nothing the graph returns, directly or through views, is removed: an output must not start aliasing an
input or another output (the trainer adds later micro-batches' gradients into them in place).
Record: ``removed_noops`` by op, ``removed_dead``.
"""

from __future__ import annotations

import torch
import torch.fx

from lockstep.graph.passes import GraphPass, PassContext, analysis, register_pass

aten = torch.ops.aten

_ALIASES = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}
_SHAPE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_COPIES = {aten.clone.default, aten._to_copy.default}


def _same_layout(a: object, b: object) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device and a.layout == b.layout)


def _written(node: torch.fx.Node) -> bool:
    """Whether any op writes into ``node``'s result or a view of it."""
    for user in node.users:
        target = user.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            return True
        if analysis.is_view(user) and _written(user):
            return True
    return False


def _feeds_output(node: torch.fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it."""
    return any(user.op == "output" or (analysis.is_view(user) and _feeds_output(user)) for user in node.users)


def _noop_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node ``node`` can be replaced by, or None when it does real work."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    source = node.args[0]
    if _feeds_output(node):
        return None
    val, source_val = node.meta.get("val"), source.meta.get("val")
    if node.target in _ALIASES:
        return source
    if node.target in _SHAPE_VIEWS:
        return source if _same_layout(val, source_val) else None
    if node.target in _COPIES:
        # a copy is only a no-op when nothing writes to either side and the bits land in the same layout
        safe = (source.op != "placeholder" and not analysis.is_view(source) and _same_layout(val, source_val)
                and not _written(node) and not _written(source))
        return source if safe else None
    return None


def cleanup(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    removed: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        source = _noop_input(node)
        if source is None:
            continue
        node.replace_all_uses_with(source)
        name = analysis.op_name(node)
        removed[name] = removed.get(name, 0) + 1
        gm.graph.erase_node(node)
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=analysis.is_impure)
    ctx.records.setdefault("cleanup", {}).update(removed_noops=removed, removed_dead=before - len(gm.graph.nodes))
    return gm


register_pass(GraphPass("cleanup", cleanup, changes_numerics=False, default=True,
                        doc="dead code and no-op views/detaches/copies removed"))
