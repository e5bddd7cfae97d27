"""The configuration base every buildable lockstep component derives from.

A component's ``Config`` is a plain, typed dataclass whose fields carry defaults and a one-line doc
(the ``#:`` comment or docstring convention tyro reads). ``build(...)`` turns it into the live object;
structural sizes the parent knows (dims, world layout) are passed to ``build`` as keyword arguments,
so a config stays small and replaceable. ``validate()`` checks values up front and raises
:class:`ConfigError` naming the field. Every float field must be finite (:func:`check_finite`); a field
where ``inf`` means something ("no limit") opts in with ``dataclasses.field(metadata=ALLOW_INF)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and what is allowed."""


#: field metadata of a float field where ``inf`` is meaningful (NaN is refused everywhere)
ALLOW_INF = {"allow_inf": True}


@dataclasses.dataclass(kw_only=True)
class Config:
    """Base class for component configs: a dataclass with ``build`` and ``validate``."""

    def build(self, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define build()")

    def validate(self, path: str = "") -> None:
        """Validate this config and every nested config, raising ConfigError naming the field."""
        check_finite(self, path)
        for name, value in iter_children(self):
            value.validate(join_path(path, name))

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed (unknown field names are an error)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} has no field(s) {unknown}; fields are {sorted(known)}"
            )
        return dataclasses.replace(self, **changes)


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def iter_children(config: Config) -> Iterator[tuple[str, Config]]:
    """Nested Config fields (direct children only), including those inside lists."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, Config):
            yield field.name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, Config):
                    yield f"{field.name}.{i}", item


def check_finite(config: Config, path: str = "") -> None:
    """Every float field of ``config`` and its nested configs is finite: a learning rate, temperature,
    coefficient or epsilon of ``inf``/``nan`` would only turn into non-finite weights or samples later.
    A field with :data:`ALLOW_INF` metadata may be ``inf`` (never ``nan``)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            if not (math.isinf(value) and field.metadata.get("allow_inf")):
                allowed = "a finite number or inf" if field.metadata.get("allow_inf") else "a finite number"
                raise ConfigError(f"{join_path(path, field.name)}: must be {allowed}, got {value!r}")
    for name, child in iter_children(config):
        check_finite(child, join_path(path, name))


def require(condition: bool, field: str, message: str) -> None:
    """Raise ConfigError(field: message) unless condition holds."""
    if not condition:
        raise ConfigError(f"{field}: {message}")


def require_positive(value: float, field: str) -> None:
    require(value > 0, field, f"must be > 0, got {value!r}")


def require_choice(value: Any, choices: Iterable[Any], field: str) -> None:
    choices = list(choices)
    require(value in choices, field, f"must be one of {choices}, got {value!r}")


def set_by_path(config: Config, dotted: str, value: Any, _full: str = "") -> Config:
    """Return a copy of ``config`` with the field at ``a.b.c`` set to ``value``.

    Unknown fields raise ConfigError listing the fields that do exist at that level.
    """
    full = _full or dotted
    head, _, rest = dotted.partition(".")
    known = {f.name for f in dataclasses.fields(config)}
    if head not in known:
        raise ConfigError(
            f"unknown field {full!r}: {type(config).__name__} has fields {sorted(known)}"
        )
    if not rest:
        return dataclasses.replace(config, **{head: value})
    child = getattr(config, head)
    if not isinstance(child, Config):
        raise ConfigError(f"field {head!r} of {type(config).__name__} has no sub-field {rest!r}")
    return dataclasses.replace(config, **{head: set_by_path(child, rest, value, full)})


def to_dict(config: Any) -> Any:
    """A JSON-ready view of a config tree, with each config's class name under ``_type``."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out: dict[str, Any] = {"_type": type(config).__name__}
        for field in dataclasses.fields(config):
            out[field.name] = to_dict(getattr(config, field.name))
        return out
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {str(k): to_dict(v) for k, v in config.items()}
    if isinstance(config, (str, int, float, bool)) or config is None:
        return config
    return str(config)
