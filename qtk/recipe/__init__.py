"""Recipes: what to quantize and how (schema.py), which scheme each module gets (rules.py), the parameters of each
algorithm step (params.py), and reading recipe files (load.py)."""

from qtk.quant.scheme import FP8_MAX, QuantScheme
from qtk.recipe.load import RECIPES_DIR, builtin_recipes, load_recipe, parse_recipe_text
from qtk.recipe.rules import ModuleScheme, Override, matches
from qtk.recipe.schema import TOP_KEYS, Calibration, Recipe, Step, checked_scheme, parse_recipe, parse_scheme

__all__ = ["FP8_MAX", "QuantScheme", "RECIPES_DIR", "builtin_recipes", "load_recipe", "parse_recipe_text", "ModuleScheme",
           "Override", "matches", "TOP_KEYS", "Calibration", "Recipe", "Step", "checked_scheme", "parse_recipe", "parse_scheme"]
