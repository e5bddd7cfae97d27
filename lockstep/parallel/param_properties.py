"""Parameter attributes that compute their value on read: a module's class swapped for a subclass.

Sharding schemes that keep a parameter's *storage* local (traceable FSDP's DTensor shards,
FlexShard's local pieces) but want ``module.weight`` inside a forward to be the whole tensor give the
module a generated subclass whose parameter names are properties. ``state_dict``,
``named_parameters`` and the optimizer read ``module._parameters`` directly: they still see the
stored tensors. ``isinstance`` checks keep working (the subclass derives from the original class).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_CLASS_CACHE: dict[tuple[type, frozenset[str], str], type] = {}


def swap_in_properties(module: nn.Module, names: list[str], make_property: Callable[[str], property],
                       prefix: str) -> None:
    """Give ``module`` a subclass (named ``prefix + the class name``, cached per class, names and
    prefix) whose attributes ``names`` are ``make_property(name)``. ``make_property`` must depend only
    on ``prefix`` and the name (the class is shared by every module of that class and names)."""
    base = type(module)
    key = (base, frozenset(names), prefix)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"{prefix}{base.__name__}", (base,), {n: make_property(n) for n in names})
    module.__class__ = _CLASS_CACHE[key]
