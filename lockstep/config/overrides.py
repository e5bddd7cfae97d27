"""Component overrides: replace the config of every module whose path matches a glob.

A model exposes its replaceable components as *slots*: a mapping from a module path such as
``layers.3.attention`` to the config that will build it. An override ``("layers.*.attention",
AttentionConfig(backend="reference"))`` swaps the config of every matching slot before the model
is built. Two overrides that touch the same slot, or an override that matches nothing, are errors:
silence here would train a different model from the one the user asked for.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from lockstep.config.base import Config, ConfigError


@dataclasses.dataclass(kw_only=True)
class ComponentOverride(Config):
    """Replace the config of every module whose path matches ``pattern``."""

    #: glob over module paths, e.g. "layers.*.attention" or "layers.0.attention_norm"
    pattern: str
    #: the component config that replaces the matched modules' configs
    config: Config

    def validate(self, path: str = "") -> None:
        if not self.pattern:
            raise ConfigError(f"{path}.pattern: must be a non-empty glob")
        self.config.validate(f"{path}.config")


def match_module_globs(paths: Iterable[str], patterns: list[str], field: str) -> dict[str, list[str]]:
    """Each glob in ``patterns`` -> the module paths it matches (``fnmatch``, case-sensitive), in path
    order. A glob that matches nothing is a ConfigError naming ``field``: the one matching rule of
    overrides, compiled modules and activation save regions."""
    paths = list(paths)
    result: dict[str, list[str]] = {}
    for pattern in patterns:
        if not pattern:
            raise ConfigError(f"{field}: must be a non-empty glob")
        matched = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            raise ConfigError(f"{field}: {pattern!r} matches no module; module paths look like {sorted(paths)[:6]}")
        result[pattern] = matched
    return result


def apply_overrides(
    slots: Mapping[str, Config], overrides: list[ComponentOverride]
) -> dict[str, Config]:
    """Return ``slots`` with every override applied, checking conflicts and dead patterns."""
    result = dict(slots)
    owner: dict[str, str] = {}
    for override in overrides:
        matched = match_module_globs(slots, [override.pattern], f"override {override.pattern!r}")[override.pattern]
        for path in matched:
            if path in owner:
                raise ConfigError(
                    f"overrides {owner[path]!r} and {override.pattern!r} both replace module {path!r}"
                )
            expected = type(slots[path])
            if not isinstance(override.config, _slot_family(expected)):
                raise ConfigError(
                    f"override {override.pattern!r} gives a {type(override.config).__name__} to "
                    f"module {path!r}, which takes a {expected.__name__}-like config"
                )
            owner[path] = override.pattern
            result[path] = override.config
    return result


def _slot_family(config_type: type) -> type:
    """The base class an override for this slot must derive from (its kind, e.g. any norm)."""
    return getattr(config_type, "slot_kind", config_type)
