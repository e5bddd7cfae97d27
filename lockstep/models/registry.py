"""Model registry: family name -> ModelSpec (its flavors and how to build them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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
    #: converter to/from Hugging Face config.json + state dict (a lockstep.models.hf.adapter.HFAdapter)
    hf_adapter: Any = None


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    _REGISTRY[spec.name] = spec
    return spec


def _ensure_families_loaded() -> None:
    # Importing the family packages registers them; kept lazy to avoid import cycles.
    import lockstep.models.llama3  # noqa: F401
    import lockstep.models.qwen3  # noqa: F401
    import lockstep.models.qwen3_moe  # noqa: F401
    import lockstep.models.deepseek_v3  # noqa: F401
    import lockstep.models.qwen3_next  # noqa: F401
    import lockstep.models.qwen3_5  # noqa: F401
    import lockstep.models.gpt_oss  # noqa: F401
    import lockstep.models.deepseek_v32  # noqa: F401
    import lockstep.models.qwen3_vl  # noqa: F401
    import lockstep.models.deepseek_v4  # noqa: F401
    import lockstep.models.kimi_k25  # noqa: F401
    # (new families: add one import line here)


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


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The family that reads Hugging Face checkpoints of ``model_type``."""
    _ensure_families_loaded()
    for spec in _REGISTRY.values():
        if model_type in spec.hf_model_types:
            return spec
    known = sorted(t for s in _REGISTRY.values() for t in s.hf_model_types)
    raise ConfigError(f"config.json model_type {model_type!r} is not supported; supported: {known}")
