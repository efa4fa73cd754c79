"""`hf-dflash recipe`: one command from a causal-LM target to an exported drafter (docs/recipe.md)."""

from .defaults import DerivedSetting, derive_defaults
from .runner import run_recipe

__all__ = ["DerivedSetting", "derive_defaults", "run_recipe"]
