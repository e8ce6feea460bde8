"""NVFP4 training: the recipe, operands by role, the autograd linear and the grouped linear.

`TrainingConfig` (for `quantize_`) imports torchao, so it loads on first use.
"""

from qtensor.training.grouped import GroupedLinear
from qtensor.training.linear import TrainingLinear, TrainingLinearFunction
from qtensor.training.recipe import NVFP4TrainingRecipe
from qtensor.training.roles import OperandSpecs, RoleSpec, SRSeeds
from qtensor.training.weight_cache import WeightCache


def __getattr__(name):
    if name == "TrainingConfig":
        from qtensor.training.config import TrainingConfig

        return TrainingConfig
    raise AttributeError(f"module 'qtensor.training' has no attribute {name!r}")


__all__ = [
    "GroupedLinear",
    "NVFP4TrainingRecipe",
    "OperandSpecs",
    "RoleSpec",
    "SRSeeds",
    "TrainingConfig",
    "TrainingLinear",
    "TrainingLinearFunction",
    "WeightCache",
]
