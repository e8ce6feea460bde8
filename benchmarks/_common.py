"""Pieces the benchmark scripts share: CUDA-event timing, host-loop timing, CUDA-graph capture,
and the RL training configuration.

Each script runs as `python benchmarks/NAME.py`, which puts this folder on sys.path, so they
import it as `_common`. `qtensor bench` runs only `bench_*.py`, never this module.
"""

from __future__ import annotations

import statistics
import time

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


def loop_us(calls, reps: int, wait: bool) -> float:
    """Median microseconds per call of `calls` (zero-argument callables) run back to back,
    synchronized before each loop, and after it too when `wait` (the wall time; without, the
    host's time to issue them, where the loop is too short to fill the launch queue)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for call in calls:
            call()
        if wait:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / len(calls) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def capture_graph(calls) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` (zero-argument callables) in order, each run once first on a
    side stream, as capture needs (lazy initialisation, the allocator's blocks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def mxfp8_backward_specs(recipe: NVFP4TrainingRecipe) -> OperandSpecs:
    """The recipe's NVFP4 forward operands with MXFP8 dgrad and wgrad, composed from the pieces."""
    s = recipe.operand_specs()
    return OperandSpecs(
        input=RoleSpec(s.input.rowwise, MXFP8Spec(columnwise=True)),
        weight=RoleSpec(s.weight.rowwise, MXFP8Spec(columnwise=True)),
        grad_output=RoleSpec(MXFP8Spec(), MXFP8Spec(columnwise=True)),
    )
