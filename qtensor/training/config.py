"""TrainingConfig: `torchao.quantization.quantize_(model, TrainingConfig(recipe))`.

Registered with torchao's handler registry, like the inference configs of qtensor/quantize.py.
Every selected nn.Linear becomes a TrainingLinear that shares its Parameters (so an optimizer
built before or after the call keeps working); a GroupedLinear selected by filter_fn takes the
config's recipe. Importing this module imports torchao.
"""

from __future__ import annotations

import dataclasses
import itertools

from torch import nn
import qtensor._torchao  # noqa: F401  (torchao without its import-time noise)
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from qtensor.training.grouped import GroupedLinear
from qtensor.training.linear import TrainingLinear, shape_error
from qtensor.training.recipe import NVFP4TrainingRecipe


@dataclasses.dataclass(frozen=True)
class TrainingConfig(AOBaseConfig):
    """Train the selected linears with an NVFP4TrainingRecipe."""

    recipe: NVFP4TrainingRecipe = NVFP4TrainingRecipe()
    # Leave layers whose shapes the recipe cannot take in high precision instead of raising.
    skip_incompatible: bool = False
    def __post_init__(self):
        if not isinstance(self.recipe, NVFP4TrainingRecipe):
            raise TypeError(
                f"TrainingConfig takes an NVFP4TrainingRecipe; got {type(self.recipe).__name__}."
            )
        # Numbers the modules this config converts, in quantize_'s (deterministic) traversal
        # order; module k seeds its stochastic-rounding state from (recipe.seed, k). Not a
        # field: it is bookkeeping, outside the config's value (eq, repr, serialization).
        object.__setattr__(self, "_seed_index", itertools.count())


@register_quantize_module_handler(TrainingConfig)
def _convert(module: nn.Module, config: TrainingConfig) -> nn.Module:
    if isinstance(module, GroupedLinear):
        return module.with_recipe(config.recipe, next(config._seed_index))
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"TrainingConfig applies to nn.Linear and GroupedLinear; got {type(module).__name__}. "
            "Narrow filter_fn."
        )
    why = shape_error(module.in_features, module.out_features, config.recipe)
    if why:
        if config.skip_incompatible:
            return module
        raise ValueError(
            f"{why} at {module}. Exclude it with filter_fn, or pass skip_incompatible=True to "
            "leave such layers in high precision."
        )
    return TrainingLinear.from_linear(module, config.recipe, next(config._seed_index))
