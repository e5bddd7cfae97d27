"""Model registry: family name -> ModelSpec (its flavors and how to build them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What lockstep knows about one model family."""

    name: str
    #: flavor name -> factory of its full config
    flavors: dict[str, Callable[[], TransformerConfig]]
    #: Hugging Face ``model_type`` values this family reads and writes
    hf_model_types: tuple[str, ...] = ()
    description: str = ""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    _REGISTRY[spec.name] = spec
    return spec


def _ensure_families_loaded() -> None:
    # Importing the family packages registers them; kept lazy to avoid import cycles.
    import lockstep.models.llama3  # noqa: F401
    import lockstep.models.qwen3  # noqa: F401


def model_families() -> list[str]:
    _ensure_families_loaded()
    return sorted(_REGISTRY)


def get_model_spec(family: str) -> ModelSpec:
    _ensure_families_loaded()
    if family not in _REGISTRY:
        raise ConfigError(f"model.family: unknown family {family!r}; choose from {sorted(_REGISTRY)}")
    return _REGISTRY[family]


def model_config(family: str, flavor: str) -> TransformerConfig:
    """The full config of ``family``'s ``flavor`` (a fresh copy each call)."""
    spec = get_model_spec(family)
    if flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor: {family} has no flavor {flavor!r}; choose from {list(spec.flavors)}"
        )
    return spec.flavors[flavor]()
