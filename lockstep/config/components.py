"""Named component kinds, so an override can be written on the command line.

``--override 'layers.*.attention=attention,backend=reference'`` builds a ``ComponentOverride``
whose config is the kind registered as ``attention`` with ``backend`` set. Field values are parsed
by the field's declared type (int, float, bool, str).
"""

from __future__ import annotations

import dataclasses
import typing

from lockstep.config.base import Config, ConfigError
from lockstep.config.overrides import ComponentOverride

_KINDS: dict[str, type[Config]] = {}


def register_component(name: str, config_type: type[Config]) -> None:
    _KINDS[name] = config_type


def component_kinds() -> list[str]:
    return sorted(_KINDS)


def _parse_value(raw: str, annotation: typing.Any, where: str) -> typing.Any:
    if annotation in (bool, "bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {raw!r}")
    for kind in (int, float):
        if annotation in (kind, kind.__name__):
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{where}: expected {kind.__name__}, got {raw!r}") from None
    return raw


def parse_override(spec: str, bases: typing.Sequence[Config] = ()) -> ComponentOverride:
    """Parse ``PATTERN=KIND[,field=value,...]`` into a ComponentOverride.

    Unnamed fields start from the first config in ``bases`` of the same kind (the model's own
    setting, so ``attention,backend=reference`` keeps a Qwen3's q/k norm), else from defaults.
    """
    pattern, sep, rest = spec.partition("=")
    if not sep or not pattern or not rest:
        raise ConfigError(f"--override {spec!r}: expected PATTERN=KIND[,field=value...]")
    kind, *assignments = rest.split(",")
    if kind not in _KINDS:
        raise ConfigError(f"--override {spec!r}: unknown component kind {kind!r}; choose from {component_kinds()}")
    cls = _KINDS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, typing.Any] = {}
    for assignment in assignments:
        name, eq, raw = assignment.partition("=")
        if not eq or name not in fields:
            raise ConfigError(
                f"--override {spec!r}: {kind} has no field {name!r}; fields are {sorted(fields)}"
            )
        values[name] = _parse_value(raw, hints.get(name), f"--override {spec!r} field {name}")
    base = next((b for b in bases if type(b) is cls), None)
    config = dataclasses.replace(base, **values) if base is not None else cls(**values)
    return ComponentOverride(pattern=pattern, config=config)
