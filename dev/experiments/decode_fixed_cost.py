"""How the decode GEMM's time splits into a fixed cost per launch and a streaming rate.

    python dev/experiments/decode_fixed_cost.py [--n 8192] [--ks 1024,2048,...] [--m 1]

For one weight height N and a sweep of K, each weight format's kernel is timed from a CUDA graph
(many launches back to back, rotating copies that exceed the L2, as in bench_gemm.py), with and
without overlapped launches, beside bf16 F.linear. A least-squares line t = a + bytes / rate over
the sweep gives the fixed cost a (what a launch costs beyond streaming its bytes: the ramp, the
split-K reduction, the tail) and the streaming rate; the residuals say how straight the line is.
Run on the GPU; the results, with date and device, are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from bench_gemm import graph_ms, packed_weights, rotating  # noqa: E402


def fit(points):
    """Least squares t = a + b * x over (x, t) points: (a, b, largest |residual|)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx
    a = mt - b * mx
    return a, b, max(abs(t - a - b * x) for x, t in points)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--ks", default="1024,2048,4096,8192,16384,28672")
    p.add_argument("--m", type=int, default=1)
    args = p.parse_args()
    from qtensor.ops import decode_mm as dmm

    n, m = args.n, args.m
    ks = [int(k) for k in args.ks.split(",")]
    series: dict[str, list[tuple[float, float]]] = {}
    print(f"# {torch.cuda.get_device_name()}, N = {n}, M = {m}: us per launch from a CUDA graph")
    print("| K | path | us | weight MB |")
    print("|---|---|---|---|")
    for k in ks:
        g = torch.Generator("cuda").manual_seed(k)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        _, wb_next = rotating(lambda i: w.roll(i, 0).contiguous(), n * k * 2)
        us = graph_ms(lambda: F.linear(x, wb_next())) * 1e3
        series.setdefault("bf16 F.linear", []).append((n * k * 2 / 1e6, us))
        print(f"| {k} | bf16 F.linear | {us:.1f} | {n * k * 2 / 1e6:.1f} |")
        for fmt, v in packed_weights(w).items():
            _, nxt = rotating(lambda i, v=v: tuple(t.roll(i) if t is not None and t.dim() else t
                                                  for t in v), v[0].numel() + v[1].numel())
            mb = (v[0].numel() + v[1].numel()) / 1e6
            for pdl in (True, False):
                def run(nxt=nxt, fmt=fmt, pdl=pdl):
                    c, s, a = nxt()
                    return dmm._launch(x, c, s, a, None, fmt, n, k, 448, torch.bfloat16, pdl=pdl)

                us = graph_ms(run) * 1e3
                name = f"{fmt}{'' if pdl else ' (no overlap)'}"
                series.setdefault(name, []).append((mb, us))
                print(f"| {k} | {name} | {us:.1f} | {mb:.1f} |")
    print("\n| path | fixed cost (us) | streaming rate (TB/s) | largest residual (us) |")
    print("|---|---|---|---|")
    for name, pts in series.items():
        a, b, r = fit(pts)
        print(f"| {name} | {a:.1f} | {1 / b:.2f} | {r:.1f} |")


if __name__ == "__main__":
    main()
