"""Named recipes: plain functions returning a whole ``TrainerConfig``, listed by ``lockstep recipes``."""

from lockstep.recipes.registry import get_recipe, recipe, recipe_names, recipes  # noqa: F401
from lockstep.recipes import low_precision, parallel, pretrain, rl, smollm2, vision  # noqa: F401  (registers the recipes)
