"""Recipe registry: name -> (function returning a TrainerConfig or an RLConfig, one-line description)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lockstep.config.base import ConfigError
from lockstep.train.config import TrainerConfig


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    fn: Callable[[], TrainerConfig]

    def config(self) -> TrainerConfig:
        cfg = self.fn()
        return dataclasses.replace(cfg, recipe=self.name)

    @property
    def kind(self) -> str:
        """"train" (a TrainerConfig, ``lockstep train``) or "rl" (an RLConfig, ``lockstep rl``)."""
        return "train" if isinstance(self.fn(), TrainerConfig) else "rl"


_RECIPES: dict[str, Recipe] = {}


def recipe(name: str, description: str) -> Callable[[Callable[[], TrainerConfig]], Callable[[], TrainerConfig]]:
    """Register ``fn`` as recipe ``name``."""

    def decorator(fn: Callable[[], TrainerConfig]) -> Callable[[], TrainerConfig]:
        if name in _RECIPES:
            raise ValueError(f"recipe {name!r} is registered twice")
        _RECIPES[name] = Recipe(name, description, fn)
        return fn

    return decorator


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def recipes() -> list[Recipe]:
    return [_RECIPES[n] for n in recipe_names()]


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        raise ConfigError(f"--recipe: unknown recipe {name!r}; choose from {recipe_names()}")
    return _RECIPES[name]
