"""Environments by name, so a recipe can pick one: ``get_environment("reasoning_gym:chain_sum")``.

A name is ``family`` or ``family:argument``. Each family is an environment ``Config`` class
registered with :func:`register_environment`; the argument, when given, fills the field the family
names (``reasoning_gym:countdown`` sets ``dataset="countdown"``; ``math:gsm_symbolic`` sets
``source="gsm_symbolic"``). Other fields are keyword arguments::

    config = environment_config("calculator", max_calls=2)   # a Config a recipe can hold
    env = config.build()                                     # == get_environment("calculator", max_calls=2)

Adding your own::

    @register_environment("my_env")
    @dataclasses.dataclass(kw_only=True)
    class MyEnvConfig(Config):
        def build(self) -> Environment: return MyEnv(self)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from lockstep.config.base import Config, ConfigError
from lockstep.rl.envs.base import Environment

C = TypeVar("C", bound=type)


@dataclasses.dataclass(frozen=True)
class _Entry:
    config_cls: type[Config]
    #: the field a ``family:argument`` name sets (None: the family takes no argument)
    argument: str | None
    doc: str


_REGISTRY: dict[str, _Entry] = {}


def register_environment(family: str, *, argument: str | None = None, doc: str = "") -> Callable[[C], C]:
    """Class decorator: register an environment ``Config`` under ``family`` (see the module docstring)."""
    if not family or ":" in family:
        raise ValueError(f"register_environment: family must be a non-empty name without ':', got {family!r}")

    def decorate(config_cls: C) -> C:
        if not (isinstance(config_cls, type) and issubclass(config_cls, Config)
                and dataclasses.is_dataclass(config_cls)):
            raise TypeError(f"register_environment({family!r}): expected a dataclass Config subclass, "
                            f"got {config_cls!r}")
        if family in _REGISTRY and _REGISTRY[family].config_cls is not config_cls:
            raise ValueError(f"register_environment: {family!r} is already registered "
                             f"({_REGISTRY[family].config_cls.__name__})")
        fields = {f.name for f in dataclasses.fields(config_cls)}
        if argument is not None and argument not in fields:
            raise ValueError(f"register_environment({family!r}): argument field {argument!r} is not a field "
                             f"of {config_cls.__name__} (fields: {sorted(fields)})")
        text = doc or ((config_cls.__doc__ or "").strip().splitlines() or [""])[0]
        _REGISTRY[family] = _Entry(config_cls, argument, text)
        return config_cls

    return decorate


def list_environments() -> dict[str, str]:
    """Registered families (``family`` or ``family:<argument field>``) -> one-line description."""
    return {(f"{k}:<{e.argument}>" if e.argument else k): e.doc for k, e in sorted(_REGISTRY.items())}


def environment_config(name: str, **fields: Any) -> Config:
    """The validated ``Config`` of environment ``name`` with ``fields`` set (ConfigError on a bad one)."""
    family, sep, argument = name.partition(":")
    if family not in _REGISTRY:
        raise ConfigError(f"environment: unknown environment {name!r}; registered: {sorted(list_environments())}")
    entry = _REGISTRY[family]
    if sep:
        if entry.argument is None:
            raise ConfigError(f"environment: {family!r} takes no ':argument', got {name!r}")
        if not argument:
            raise ConfigError(f"environment: {name!r} is missing the {entry.argument} after ':'")
        if entry.argument in fields:
            raise ConfigError(f"environment: {entry.argument} given twice ({name!r} and {entry.argument}=)")
        fields[entry.argument] = argument
    known = {f.name for f in dataclasses.fields(entry.config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"environment {family!r}: no field(s) {unknown}; fields are {sorted(known)}")
    config = entry.config_cls(**fields)
    config.validate(f"environment[{name}]")
    return config


def get_environment(name: str, **fields: Any) -> Environment:
    """``environment_config(name, **fields).build()``."""
    return environment_config(name, **fields).build()
