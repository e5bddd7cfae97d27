"""TransformerConfig <-> plain dict (JSON), the inverse of ``lockstep.config.base.to_dict``.

``to_dict`` writes each config as a dict with its class name under ``_type``. ``config_from_dict``
rebuilds the tree by the declared type of every field: a nested config is rebuilt as the class
its ``_type`` names (which must be the field's declared class or a subclass of it, so a
``feed_forward`` dict may name any ``FeedForwardConfig`` kind), lists of configs element by element.
Unknown fields and unknown ``_type`` names raise :class:`ConfigError` naming the path.

``check_same_architecture`` compares a run's config with a checkpoint's: they may differ only in
what does not change the function computed (flavor name, init_std, the attention backend, also
through overrides, ``max_seq_len``: RoPE tables are computed, not stored, and a sparse indexer's
training knobs ``loss_weight`` / ``stage``: a warm-up checkpoint goes on training sparsely).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from lockstep.config.base import Config, ConfigError, to_dict
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.transformer import TransformerConfig

__all__ = ["IGNORED_FIELDS", "check_same_architecture", "config_from_dict", "config_to_dict"]

#: TransformerConfig fields a run may change without changing the checkpoint's function
IGNORED_FIELDS = ("flavor", "init_std", "max_seq_len", "overrides")


def config_to_dict(config: Config) -> dict[str, Any]:
    """A JSON-ready dict of ``config`` (with ``_type`` keys), readable by ``config_from_dict``."""
    return to_dict(config)


def config_from_dict(data: dict[str, Any], cls: type[Config] = TransformerConfig, path: str = "model") -> Any:
    """Rebuild a config of (a subclass of) ``cls`` from ``data`` as written by ``to_dict``."""
    _load_known_kinds()
    return _build(cls, data, path)


def _load_known_kinds() -> None:
    # Importing the family packages imports every component config they use, so subclasses
    # defined there (e.g. a mixture-of-experts feed-forward) are found by name.
    from lockstep.models.registry import model_families

    model_families()


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(current.__subclasses__())
    return found


def _resolve_class(declared: type, type_name: str | None, path: str) -> type:
    if type_name is None or type_name == declared.__name__:
        return declared
    candidates = [c for c in _subclasses(declared) if c.__name__ == type_name and dataclasses.is_dataclass(c)]
    if not candidates:
        known = sorted({c.__name__ for c in _subclasses(declared) if dataclasses.is_dataclass(c)})
        raise ConfigError(
            f"{path}._type: unknown config class {type_name!r} for a {declared.__name__} field; "
            f"known: {known}"
        )
    return candidates[0]


def _build(declared: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a dict for {declared.__name__}, got {type(data).__name__}")
    cls = _resolve_class(declared, data.get("_type"), path)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(k for k in data if k != "_type" and k not in fields)
    if unknown:
        raise ConfigError(f"{path}: {cls.__name__} has no field(s) {unknown}; fields are {sorted(fields)}")
    kwargs = {name: _value(hints[name], data[name], f"{path}.{name}") for name in fields if name in data}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{path}: cannot build {cls.__name__}: {err}") from None


def _value(hint: Any, value: Any, path: str) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return _value(options[0], value, path)
        return value
    if origin in (list, tuple):
        args = typing.get_args(hint)
        item = args[0] if args else Any
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        items = [_value(item, v, f"{path}.{i}") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, bool, str) and not isinstance(value, hint):
        raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value


# -- architecture comparison ---------------------------------------------------------------------


def _architecture(config: TransformerConfig) -> dict[str, Any]:
    """The config as a dict, without the fields that do not change what the model computes."""
    def strip(slot: Any) -> Any:
        if isinstance(slot, AttentionConfig):
            slot = dataclasses.replace(slot, backend="sdpa")
            if getattr(slot, "indexer", None) is not None:  # DeepSeek-V3.2: the indexer's training knobs
                slot = dataclasses.replace(slot, indexer=dataclasses.replace(slot.indexer, loss_weight=0.0,
                                                                             stage="sparse"))
        return to_dict(slot)

    out = {k: v for k, v in to_dict(config).items() if k not in IGNORED_FIELDS}
    out["attention"] = strip(config.attention)
    out["slots"] = {path: strip(slot) for path, slot in config.slots().items()}
    return out


def check_same_architecture(checkpoint: TransformerConfig, run: TransformerConfig, where: str) -> None:
    """ConfigError naming every field where ``run`` computes something other than ``checkpoint``."""
    a, b = _architecture(checkpoint), _architecture(run)
    diffs = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y)):
                walk(x.get(key), y.get(key), f"{path}.{key}" if path else key)
        elif x != y:
            diffs.append(f"model.{path}: checkpoint has {x!r}, run config has {y!r}")

    walk(a, b, "")
    if diffs:
        raise ConfigError(f"{where}: the run's model config does not match the checkpoint: "
                          + "; ".join(d.replace("model.slots.", "model slot ") for d in diffs[:12])
                          + (f"; ... ({len(diffs) - 12} more)" if len(diffs) > 12 else ""))
