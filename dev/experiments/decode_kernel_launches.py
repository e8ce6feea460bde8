"""Launches of the decode GEMM alone, for Nsight Compute: what bounds its streaming rate.

    ncu --clock-control none -k regex:decode_gemm --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        python dev/experiments/decode_kernel_launches.py [--shapes 28672x8192] [--ms 1,16]

Each weight format's kernel runs three times on each N x K shape and token count (the first
launch warms up; profile the last, e.g. with ncu's --launch-skip). decode_fixed_cost.py measures
the rate these launches stream at; this script gives the profiler the same launches alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from bench_gemm import packed_weights  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="28672x8192")
    p.add_argument("--ms", default="1,16")
    p.add_argument("--formats", default="nvfp4,mxfp4,mxfp8")
    args = p.parse_args()
    from qtensor.ops import decode_mm as dmm

    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed = packed_weights(w)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for fmt in args.formats.split(","):
                c, s, a = packed[fmt]
                torch.cuda.nvtx.range_push(f"{fmt} {n}x{k} M={m}")
                for _ in range(3):
                    dmm._launch(x, c, s, a, None, fmt, n, k, 448, torch.bfloat16)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                print(f"{fmt} {n}x{k} M={m}: 3 launches")


if __name__ == "__main__":
    main()
