"""Whether the decode GEMM's K split, chosen so that every cluster is resident at once, is the
fastest one on large weights.

    python dev/experiments/decode_splits.py [--shapes 28672x8192,8192x28672] [--ms 1,16]

For each N x K shape, token count and weight format, the kernel is timed from a CUDA graph
(rotating copies that exceed the L2, as in bench_gemm.py) with the split it chooses and with
each forced split of 1-6 (a split whose clusters do not all fit on the GPU at once runs in more
than one wave). Run on the GPU; results, with date and device, in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from bench_gemm import graph_ms, packed_weights, rotating  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="28672x8192,8192x28672")
    p.add_argument("--ms", default="1,16")
    p.add_argument("--splits", default="1,2,3,4,6")
    args = p.parse_args()
    from qtensor.ops import decode_mm as dmm

    forced = [int(s) for s in args.splits.split(",")]
    print(f"# {torch.cuda.get_device_name()}: decode GEMM us by K split (0: its own choice)")
    print("| weight | M | format | " + " | ".join(str(s) for s in [0] + forced) + " |")
    print("|---|---|---|" + "---|" * (1 + len(forced)))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for fmt, v in packed_weights(w).items():
            _, nxt = rotating(lambda i, v=v: tuple(t.roll(i) if t is not None and t.dim() else t
                                                  for t in v), v[0].numel() + v[1].numel())
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                cells = []
                for sp in [0] + forced:
                    def run(nxt=nxt, fmt=fmt, sp=sp, x=x):
                        c, s, a = nxt()
                        return dmm._launch(x, c, s, a, None, fmt, n, k, 448, torch.bfloat16,
                                           splits=sp)

                    cells.append(f"{graph_ms(run) * 1e3:.1f}")
                print(f"| {n}x{k} | {m} | {fmt} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
