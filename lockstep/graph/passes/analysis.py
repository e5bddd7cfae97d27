"""Facts about the nodes of a captured step that several passes and the dump share: a node's phase,
block, bytes, whether it aliases its input, draws random numbers or talks to other ranks, and what the
forward keeps alive for the backward ("saved" nodes) and how many bytes that is.

Saved bytes are counted per storage: a saved view holds its base's storage, so views are followed to
their root and each root counts once; graph inputs (parameters, buffers, the batch) are alive anyway and
count zero. This module registers no pass.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.fx

_BLOCK = re.compile(r"^(layers\.\d+)(\.|$)")
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "c10d"}
_RNG_WORDS = ("rand", "dropout", "bernoulli", "normal", "philox", "multinomial", "poisson", "exponential",
              "uniform", "cauchy", "geometric", "log_normal")
#: ops whose recomputation costs like a matmul or attention (never recomputed by the default policy)
_EXPENSIVE = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_scaled_dot_product",
              "scaled_dot_product", "_flash_attention", "_efficient_attention", "_grouped_mm", "_weight_int")


def phase(node: torch.fx.Node) -> str:
    """"forward", "backward", or "" (placeholders/output when the capture did not mark them)."""
    return node.meta.get("phase", "")


def module_path(node: torch.fx.Node) -> str:
    return node.meta.get("module_path", "")


def block_of(path: str) -> str:
    """The block a module path belongs to: "layers.N" for a transformer block, else its first
    component ("embed", "norm", ...), or "(none)" outside any module (the loss, graph inputs)."""
    match = _BLOCK.match(path)
    if match:
        return match.group(1)
    return path.split(".")[0] if path else "(none)"


def op_name(node: torch.fx.Node) -> str:
    """"aten.add.Tensor"-style name of a call_function target ("getitem" for tuple indexing)."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _packet_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def tensor_bytes(val: object) -> int:
    """Bytes of the tensor(s) in a node's ``meta["val"]`` (0 for non-tensors)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def node_bytes(node: torch.fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


def is_view(node: torch.fx.Node) -> bool:
    """True when the node's output aliases (shares storage with) its first input."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def is_rng(node: torch.fx.Node) -> bool:
    """True for an op that draws from a random generator: recomputing it would draw other numbers."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        # attention with dropout_p == 0 (every causal LM here) is tagged seeded but draws nothing
        for i, arg in enumerate(target._schema.arguments):
            if arg.name == "dropout_p":
                value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
                return value != 0
        if torch.Tag.nondeterministic_seeded in target.tags:
            return True
    name = _packet_name(node).lower()
    return any(word in name for word in _RNG_WORDS)


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes an in-place/out op writes into."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


def is_collective(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace in _COLLECTIVE_NAMESPACES


def is_impure(node: torch.fx.Node) -> bool:
    """Side effects a rewrite must keep: in-place/mutating ops, collectives, random draws, the output."""
    # random ops are judged by is_rng (torch's own rule also flags attention without dropout)
    return node.op in ("placeholder", "output") or node.is_impure(impure_random=False) or is_collective(node) \
        or is_rng(node) \
        or (isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable)


def is_expensive(node: torch.fx.Node) -> bool:
    """Matmuls and attention: what the memory policy keeps instead of recomputing."""
    name = _packet_name(node)
    return any(name.startswith(word) for word in _EXPENSIVE)


def flops(node: torch.fx.Node) -> float:
    """Rough cost of (re)computing the node: 2mnk for matmuls, 4*B*H*T*S*D for attention, the number of
    elements touched for everything else (elementwise, reductions, casts), 0 for views."""
    if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
        return 0.0
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    out = node.meta.get("val")
    name = _packet_name(node)
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm") and isinstance(out, torch.Tensor):
        mats = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2]
        k = mats[-1].shape[-2] if mats else 1
        return 2.0 * out.numel() * k
    if "attention" in name and vals and isinstance(vals[0], torch.Tensor) and len(vals) >= 2:
        q, k = vals[0], vals[1]
        return 4.0 * q.numel() * k.shape[-2]
    touched = [v.numel() for v in [*vals, out] if isinstance(v, torch.Tensor)]
    return float(max(touched, default=1))


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node owning the storage ``node`` aliases (itself unless it is a view)."""
    while is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def saved_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Forward nodes a backward op uses: what the forward keeps alive for the backward (what the graph
    returns is not counted: it lives past the step whatever the passes do)."""
    return [n for n in graph.nodes
            if n.op == "call_function" and phase(n) == "forward"
            and any(u.op == "call_function" and phase(u) == "backward" for u in n.users)]


def _counted_roots(nodes: Iterable[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    roots: dict[torch.fx.Node, int] = {}
    for node in nodes:
        root = storage_root(node)
        if root.op in ("placeholder", "get_attr") or root in roots:
            continue
        roots[root] = node_bytes(root)
    return roots


def saved_bytes(graph: torch.fx.Graph) -> int:
    """Bytes the forward keeps alive for the backward (distinct storages, graph inputs excluded)."""
    return sum(_counted_roots(saved_nodes(graph)).values())


def saved_bytes_per_block(graph: torch.fx.Graph) -> dict[str, int]:
    """:func:`saved_bytes` split by the block of the storage's owner."""
    out: dict[str, int] = {}
    for root, size in _counted_roots(saved_nodes(graph)).items():
        block = block_of(module_path(root))
        out[block] = out.get(block, 0) + size
    return out


def peak_bytes(graph: torch.fx.Graph) -> int:
    """Peak bytes of intermediate tensors alive at once when the graph runs in node order, each freed
    after its storage's last use (as GraphModule's generated code frees them); graph inputs excluded."""
    last: dict[torch.fx.Node, int] = {}
    nodes = list(graph.nodes)
    for index, node in enumerate(nodes):
        for source in node.all_input_nodes:
            root = storage_root(source)
            last[root] = max(last.get(root, -1), len(nodes) if node.op == "output" else index)
    live, peak = 0, 0
    ends: dict[int, int] = {}
    for index, node in enumerate(nodes):
        if node.op == "call_function" and not is_view(node) and storage_root(node) is node:
            size = node_bytes(node)
            live += size
            ends[last.get(node, index)] = ends.get(last.get(node, index), 0) + size
        peak = max(peak, live)
        live -= ends.pop(index, 0)
    return peak
