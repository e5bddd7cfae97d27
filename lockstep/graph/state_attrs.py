"""Tensors modules keep as plain attributes, threaded through a captured step.

A module may assign tensors to its attributes during a forward (MoE load statistics, pending
expert counts pooled over a step's micro-batches, MTP losses) and read them in a later forward or
after the step. A replayed graph runs none of that Python, so :class:`ModuleState` makes those
attributes explicit: tensors held when the capture starts are graph inputs (:meth:`read` /
:meth:`bound`), tensors held when the objective returns are graph outputs (:meth:`outputs`) assigned
back after every replay (:meth:`write`). Which attributes hold tensors (and their shapes) is part of a
capture's key (:func:`state_signature`), so a state that appears or changes shape re-captures.
Python values that are not tensors (counters, flags) are not replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

#: attributes every nn.Module has (parameters, buffers, submodules, hook tables): never module state
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

Slot = tuple[nn.Module, str]


def _tensor_attrs(model: nn.Module) -> Iterator[tuple[nn.Module, str, Any]]:
    for module in model.modules():
        for name, value in vars(module).items():
            if name in _MODULE_INTERNALS or isinstance(value, (nn.Module, str, int, float, bool, type(None))):
                continue
            if isinstance(value, torch.Tensor) or any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
                yield module, name, value


def state_signature(model: nn.Module) -> tuple:
    """Which module attributes hold tensors now, with their structure, shapes and dtypes (a capture key)."""
    index = {id(m): i for i, m in enumerate(model.modules())}
    out = []
    for module, name, value in _tensor_attrs(model):
        leaves, spec = pytree.tree_flatten(value)
        out.append((index[id(module)], name, str(spec),
                    tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves)))
    return tuple(out)


class _Layout:
    """An attribute's pytree structure with its non-tensor leaves, to rebuild it from tensors."""

    def __init__(self, value: Any) -> None:
        leaves, self.spec = pytree.tree_flatten(value)
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.constants = [None if t else x for x, t in zip(leaves, self.is_tensor)]
        self.n = sum(self.is_tensor)

    def tensors(self, value: Any) -> list[torch.Tensor]:
        return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]

    def build(self, tensors: list[torch.Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if t else c for t, c in zip(self.is_tensor, self.constants)], self.spec)


class ModuleState:
    """The tensor-holding attributes of ``model``'s modules: graph inputs at capture, outputs after."""

    def __init__(self, model: nn.Module, inputs: list[tuple[Slot, _Layout]]) -> None:
        self.model = model
        self.in_slots = inputs
        self.out_slots: list[tuple[Slot, _Layout]] = []

    @classmethod
    def collect(cls, model: nn.Module) -> "ModuleState":
        return cls(model, [((m, name), _Layout(v)) for m, name, v in _tensor_attrs(model)])

    def read(self) -> list[torch.Tensor]:
        """The input attributes' tensors now (in slot order)."""
        out: list[torch.Tensor] = []
        for (module, name), layout in self.in_slots:
            out.extend(layout.tensors(getattr(module, name)))
        return out

    @contextlib.contextmanager
    def bound(self, tensors: list) -> Iterator[None]:
        """The input attributes set to ``tensors`` (the trace's graph inputs) for the body."""
        it = iter(tensors)
        for (module, name), layout in self.in_slots:
            setattr(module, name, layout.build([next(it) for _ in range(layout.n)]))
        yield

    def outputs(self) -> list[torch.Tensor]:
        """While tracing, after the objective: the attributes that hold tensors now, or held them at
        the start, become graph outputs (recorded for :meth:`write`); returns their tensors."""
        seen = {(id(m), n) for (m, n), _ in self.in_slots}
        slots = [(m, n) for (m, n), _ in self.in_slots]
        slots += [(m, n) for m, n, _ in _tensor_attrs(self.model) if (id(m), n) not in seen]
        self.out_slots = [((m, n), _Layout(getattr(m, n, None))) for m, n in slots]
        out: list[torch.Tensor] = []
        for (module, name), layout in self.out_slots:
            out.extend(layout.tensors(getattr(module, name, None)))
        return out

    def write(self, tensors: list[torch.Tensor]) -> None:
        """After a replay: assign the output attributes from the graph's state outputs."""
        it = iter(tensors)
        for (module, name), layout in self.out_slots:
            setattr(module, name, layout.build([next(it) for _ in range(layout.n)]))

    def snapshot(self) -> dict[tuple[int, str], tuple[nn.Module, str, Any]]:
        """Every module's non-internal attributes (shallow), for :meth:`restore` after a trace."""
        return {(id(m), k): (m, k, v) for m in self.model.modules() for k, v in vars(m).items()
                if k not in _MODULE_INTERNALS}

    def restore(self, saved: dict) -> None:
        """Undo what the trace assigned to the state attributes (the traced step has not happened)."""
        for (module, name), _ in self.in_slots + self.out_slots:
            entry = saved.get((id(module), name))
            if entry is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, entry[2])
