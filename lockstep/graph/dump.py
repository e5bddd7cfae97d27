"""``graph.dump_dir``: the captured step written after each pass, for a reader and for tests.

``NN_<pass>.py`` is the graph's readable code (``print_readable``) with each node's module path and phase
as a comment; ``NN_<pass>_summary.json`` counts nodes, saved-for-backward bytes and collectives (not
their waits) per block ("layers.N", "embed", "(none)" for the loss and inputs). ``00_captured`` is the
graph before any pass.
"""

from __future__ import annotations

import json
import pathlib

import torch.fx

from lockstep.atomic import atomic_open
from lockstep.graph.passes import analysis


def summarize(gm: torch.fx.GraphModule) -> dict:
    """Per-block node counts (by phase), saved bytes and collectives of a captured step."""
    nodes: dict[str, dict[str, int]] = {}
    collectives: dict[str, dict[str, int]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        block = analysis.block_of(analysis.module_path(node))
        counts = nodes.setdefault(block, {})
        key = analysis.phase(node) or "other"
        counts[key] = counts.get(key, 0) + 1
        if analysis.is_collective(node) and "wait_tensor" not in analysis.op_name(node):  # a wait sends nothing
            ops = collectives.setdefault(block, {})
            name = analysis.op_name(node)
            ops[name] = ops.get(name, 0) + 1
    saved = analysis.saved_bytes_per_block(gm.graph)
    return {
        "nodes": sum(sum(c.values()) for c in nodes.values()),
        "saved_bytes": sum(saved.values()),
        "collectives": sum(sum(c.values()) for c in collectives.values()),
        "blocks": {block: {"nodes": nodes.get(block, {}), "saved_bytes": saved.get(block, 0),
                           "collectives": collectives.get(block, {})}
                   for block in sorted(set(nodes) | set(saved) | set(collectives))},
    }


def _annotated_code(gm: torch.fx.GraphModule) -> str:
    code = gm.print_readable(print_output=False)
    notes = [f"#   {n.name}: {analysis.phase(n) or '-'} {analysis.module_path(n) or '-'}"
             for n in gm.graph.nodes if n.op == "call_function"]
    return code + "\n\n# node -> phase, module path\n" + "\n".join(notes) + "\n"


def _write(path: pathlib.Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text.encode("utf-8"))


def dump_graph(gm: torch.fx.GraphModule, dump_dir: str, index: int, name: str, records: dict | None = None) -> None:
    """Write ``NN_<name>.py`` and ``NN_<name>_summary.json`` into ``dump_dir`` (created if missing)."""
    folder = pathlib.Path(dump_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{index:02d}_{name}"
    _write(folder / f"{stem}.py", _annotated_code(gm))
    summary = summarize(gm)
    if records:
        summary["records"] = records
    _write(folder / f"{stem}_summary.json", json.dumps(summary, indent=1, sort_keys=True, default=str))
