"""How much the RHT + SR cast and the amax after RHT depend on the spread of the input's runs.

    python dev/experiments/rht_sr_input_ranges.py          # on the GPU machine

The CUDA kernels sum a 16-run down a column in fp32 when its nonzero magnitudes lie within
2**12 of each other (Bf16Range::f32_exact in csrc/cuda_vec.cuh: fmax <= fmin + 12, fmin >= 10,
fmax <= 249 on the bf16 exponent fields); any other run goes through the reference's fp64
butterfly over a half-warp, and its warp's CTA waits for it at the staging barrier. This times
both kernels at 16384x8192 bf16, beside a copy of the same input, on inputs whose runs spread
differently, and prints for each the share of runs outside the fp32 test and the share of
warp tiles (16 rows x 64 columns: 64 runs) holding at least one:
- `narrow`: magnitudes in [1, 2) (no run outside the test);
- `gaussian`: torch.randn;
- `gaussian, half zeros`: randn with half the elements zero (zeros do not count in the test);
- `log-normal`: randn * 2**(3 randn), a spread like that of some gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_quantize import time_cuda  # noqa: E402

from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed, sr_state_tensor  # noqa: E402
from qtensor.ops import quant as Q  # noqa: E402

SHAPE = (16384, 8192)


def outside_fp32_test(x: torch.Tensor) -> torch.Tensor:
    """[M / 16, K] bool: the 16-runs down the columns that the kernels' fp32 range test refuses."""
    a = (x.view(torch.int16).to(torch.int32) & 0x7FFF).view(-1, 16, x.shape[1])
    fmax = a.amax(dim=1) >> 7
    lo = torch.where(a == 0, torch.full_like(a, 0x10000), a - 1).amin(dim=1)
    fmin = torch.where(lo == 0x10000, torch.full_like(lo, 255), lo >> 7)
    return ~((fmax <= 249) & (fmin >= 10) & (fmax <= fmin + 12))


def inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    def randn():
        return torch.randn(SHAPE, generator=g, device="cuda")

    half = randn()
    half[torch.rand(SHAPE, generator=g, device="cuda") < 0.5] = 0
    return {
        "narrow": torch.sign(randn()) * (1 + torch.rand(SHAPE, generator=g, device="cuda")),
        "gaussian": randn(),
        "gaussian, half zeros": half,
        "log-normal": randn() * torch.exp2(3 * randn()),
    }


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    spec = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    sr = sr_state_tensor(SRSeed(1, 0), "cuda")
    print(f"# {torch.cuda.get_device_name()}, {SHAPE[0]}x{SHAPE[1]} bf16; us, and the ratio to a copy")
    print("| input | runs outside fp32 | warp tiles with one | copy us | RHT + SR us | of copy | amax after RHT us |")
    print("|---|---|---|---|---|---|---|")
    for name, x in inputs(g).items():
        x = x.bfloat16()
        slow = outside_fp32_test(x)
        # a warp of the tile kernel holds one 16-row panel (one row of runs) x 64 columns
        warp_tiles = slow.view(slow.shape[0], slow.shape[1] // 64, 64).any(dim=2)
        amax = Q.amax(x, columnwise=True, rht=True)
        copy = time_cuda(lambda t: t.clone(), [x])
        cast = time_cuda(lambda t: Q.nvfp4_codes(t, amax, spec, sr), [x])
        amax_t = time_cuda(lambda t: Q.amax(t, columnwise=True, rht=True), [x])
        ratio = (2 + 0.5625) * copy / (4 * cast)  # bytes per second over the copy's
        print(f"| {name} | {slow.float().mean().item():.4f} | {warp_tiles.float().mean().item():.3f} "
              f"| {copy * 1e6:.1f} | {cast * 1e6:.1f} | {ratio:.2f} | {amax_t * 1e6:.1f} |")


if __name__ == "__main__":
    main()
