"""The pass pipeline over a captured training step: a registry of named passes.

A pass is a function ``(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule``, registered
with :func:`register_pass` under a name, saying whether it may change numerics and whether it runs by
default. Default passes must not change numerics (the graph stays bitwise equal to eager); a pass that
may change them (Inductor) is opt-in and flagged in the manifest. ``graph.enable`` / ``graph.disable``
name passes; unknown names are errors (:func:`check_pass_names`).

Node conventions every pass relies on (set by ``lockstep.graph.capture``):
``node.meta["module_path"]``: the module the op came from ("layers.3.attention"; "" outside any module,
e.g. the loss), for forward and backward nodes alike; ``node.meta["phase"]``: "forward" or "backward";
``node.meta["val"]``: a tensor with the node's shape/dtype (as make_fx records it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx

from lockstep.config.base import ConfigError


@dataclasses.dataclass
class PassContext:
    """What a pass may need beyond the graph: the config section and where to record what it did."""

    #: the ``graph`` config section (``lockstep.graph.config.GraphConfig``)
    config: object
    #: per-pass records (counts, bytes) a pass adds under its own name; the trainer logs them
    records: dict[str, dict] = dataclasses.field(default_factory=dict)
    #: free-form facts from the capture (e.g. the data-parallel mesh) a pass may read
    facts: dict[str, object] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    fn: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]
    #: True when the rewritten graph may compute different bits from eager
    changes_numerics: bool
    #: runs unless ``graph.disable`` names it (only allowed when changes_numerics is False)
    default: bool
    #: one line for docs and errors
    doc: str = ""


_REGISTRY: dict[str, GraphPass] = {}


def register_pass(graph_pass: GraphPass) -> GraphPass:
    """Add a pass to the registry (its place in the pipeline: see :func:`registered_passes`)."""
    if graph_pass.default and graph_pass.changes_numerics:
        raise ValueError(f"graph pass {graph_pass.name!r}: a pass that changes numerics cannot run by default")
    if graph_pass.name in _REGISTRY:
        raise ValueError(f"graph pass {graph_pass.name!r} is registered twice")
    _REGISTRY[graph_pass.name] = graph_pass
    return graph_pass


#: pipeline order by module (a pass module's import registers its passes): these first, in this order;
#: other modules of this package next, then the numerics-changing "inductor", which compiles what the
#: others produced and so runs last
_PIPELINE_ORDER = ("cleanup", "memory", "recompute", "bucketing")
_LAST = ("inductor",)


def _ensure_loaded() -> None:
    import importlib
    import pkgutil

    found = {info.name for info in pkgutil.iter_modules(__path__)}
    middle = sorted(found - set(_PIPELINE_ORDER) - set(_LAST))
    for name in (*_PIPELINE_ORDER, *middle, *_LAST):
        if name in found:
            importlib.import_module(f"{__name__}.{name}")


def _rank(graph_pass: GraphPass) -> int:
    module = graph_pass.fn.__module__.rsplit(".", 1)[-1]
    if module in _PIPELINE_ORDER:
        return _PIPELINE_ORDER.index(module)
    return len(_PIPELINE_ORDER) + (1 if module in _LAST else 0)


def registered_passes() -> dict[str, GraphPass]:
    """Every known pass by name, in pipeline order (by module as ``_PIPELINE_ORDER`` says, whichever
    module was imported first; passes of one module in their order of registration)."""
    _ensure_loaded()
    ordered = sorted(_REGISTRY.values(), key=_rank)  # stable: registration order within a rank
    return {p.name: p for p in ordered}


def check_pass_names(names: list[str], field: str) -> None:
    """Raise a ConfigError naming ``field`` for a name that is no registered pass."""
    known = registered_passes()
    for name in names:
        if name not in known:
            raise ConfigError(f"{field}: unknown graph pass {name!r}; known passes: {sorted(known)}")


def selected_passes(enable: list[str], disable: list[str]) -> list[GraphPass]:
    """The pipeline: default passes not disabled, plus opt-in passes enabled, in registry order."""
    return [p for p in registered_passes().values()
            if (p.default and p.name not in disable) or p.name in enable]
