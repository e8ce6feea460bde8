"""Pieces the benchmark scripts share: CUDA-event timing and the RL training configuration.

Each script runs as `python benchmarks/NAME.py`, which puts this folder on sys.path, so they
import it as `_common`. `qtensor bench` runs only `bench_*.py`, never this module.
"""

from __future__ import annotations

import statistics

import torch

from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.training import NVFP4TrainingRecipe, OperandSpecs, RoleSpec

# The RL forward of seed 000: row-scaled NVFP4 activations, 1D NVFP4 weights, no RHT, no
# stochastic rounding, no 2D blocks.
RL_FORWARD = dict(rht=False, stochastic_rounding=False, weight_2d=False, row_scaled_activation=True)


def cuda_time_ms(fn, warmup: int = 1, iters: int = 20) -> float:
    """Median milliseconds of fn() over `iters` calls timed with CUDA events (each call waited
    for), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def mxfp8_backward_specs(recipe: NVFP4TrainingRecipe) -> OperandSpecs:
    """The recipe's NVFP4 forward operands with MXFP8 dgrad and wgrad, composed from the pieces."""
    s = recipe.operand_specs()
    return OperandSpecs(
        input=RoleSpec(s.input.rowwise, MXFP8Spec(columnwise=True)),
        weight=RoleSpec(s.weight.rowwise, MXFP8Spec(columnwise=True)),
        grad_output=RoleSpec(MXFP8Spec(), MXFP8Spec(columnwise=True)),
    )
