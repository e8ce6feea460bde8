"""One launch of each quantization kernel on a 16384x8192 bf16 input, for a profiler.

    ncu --clock-control none -k regex:"tile_kernel|rows_kernel|rows_fo6_kernel|amax" \\
        python benchmarks/profile_quantize.py

Each case is an NVTX range named as in bench_quantize.py. The amaxes are computed first (their
kernels are profiled too, the amax after RHT in its own range), as the "amax given" rows of
bench_quantize.py assume.
"""

from __future__ import annotations

import torch

from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed, sr_state_tensor
from qtensor.ops import quant as Q


def main() -> None:
    x = torch.randn(16384, 8192, device="cuda").bfloat16()
    sr = sr_state_tensor(SRSeed(1, 0), "cuda")
    amax = Q.amax(x)
    torch.cuda.nvtx.range_push("amax rht (col)")
    amax_rht = Q.amax(x, columnwise=True, rht=True)
    torch.cuda.nvtx.range_pop()
    cases = {
        "nvfp4 row": lambda: Q.nvfp4_codes(x, amax, NVFP4Spec(), None),
        "nvfp4 col": lambda: Q.nvfp4_codes(x, amax, NVFP4Spec(columnwise=True), None),
        "nvfp4 col rht+sr": lambda: Q.nvfp4_codes(
            x, amax_rht, NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True), sr),
        "nvfp4 2d": lambda: Q.nvfp4_codes(x, amax, NVFP4Spec(block_2d=True), None),
        "nvfp4 4o6 mae": lambda: Q.nvfp4_codes(x, amax, NVFP4Spec(fourover6="mae", e4m3_bound=256), None),
        "nvfp4 4o6 mse 2d": lambda: Q.nvfp4_codes(
            x, amax, NVFP4Spec(fourover6="mse", block_2d=True, e4m3_bound=256), None),
        "mxfp8 col": lambda: Q.mxfp8_both(x, "rceil", False, True),
        "mxfp8 both": lambda: Q.mxfp8_both(x, "rceil", True, True),
        "hybrid grad": lambda: torch.ops.qtensor.hybrid_quantize.default(x, amax, 0, 0, 448, False, False, None),
        "hybrid grad rht+sr": lambda: torch.ops.qtensor.hybrid_quantize.default(
            x, amax_rht, 0, 0, 448, True, True, sr),
    }
    torch.cuda.synchronize()
    for name, fn in cases.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
