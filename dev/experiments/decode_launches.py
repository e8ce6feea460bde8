"""What a launch of the decode GEMM costs, and what bounds it: three measurements on the GPU.

    python dev/experiments/decode_launches.py fixed-cost [--n 8192] [--ks 1024,...] [--m 1]
    python dev/experiments/decode_launches.py splits [--shapes 28672x8192,8192x28672] [--ms 1,16]
        [--splits 1,2,3,4,6] [--tiles 0,1,4,2,3]
    python dev/experiments/decode_launches.py times [--shapes 8192x8192,...] [--ms 1,4,16,64]
    ncu --clock-control none -k regex:decode_gemm --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        python dev/experiments/decode_launches.py profile [--shapes 28672x8192] [--ms 1,16]

fixed-cost: for one weight height N and a sweep of K, each format's kernel from a CUDA graph
(many launches back to back, rotating copies that exceed the L2, as in bench_gemm.py), with and
without overlapped launches, beside bf16 F.linear; a least-squares line t = a + bytes / rate over
the sweep (bytes in MB, t in us: the rate in TB/s) splits a launch into a fixed cost a (the
ramp, the split-K reduction, the tail) and a streaming rate.

splits: each format's kernel with the K split it chooses (every cluster resident at once) and
with each forced split (one whose clusters do not all fit runs in more than one wave); the
column "own" names the split it chose, the forced launch whose output is bitwise its own. With
--tiles, each of the 33-64-token tiles named (0 the chosen one, 1 and 4 the m16n8k16 tiles of 64
and 128 rows a CTA, the latter for 4-bit weights, 2 and 3 the warpgroup tile of 64 and 128 rows,
which runs only on compute capability 9.0) gets a line of its own; below 33 tokens only the
chosen one exists.

times: each format's kernel as decode_mm launches it beside bf16 F.linear, one line per weight
and M, with the rate at which each streams its weight's bytes: the short table to compare builds
with (dev/compare_builds.sh runs it in each build; the kernel's whole benchmark, with its checks
and other rows, is bench_gemm.py --decode).

profile: three launches of each format alone, for Nsight Compute (the first warms up); with
--bf16, F.linear's three first, so that a wider filter (`-k regex:"decode_gemm|gemv|gemm"`)
profiles cuBLAS's kernel beside the decode kernel (`--section MemoryWorkloadAnalysis` gives both
kernels' DRAM and L2 throughput). With ncu's `--section SourceCounters --page source
--print-source sass --csv` instead of the sections above, `benchmarks/ncu_sass_regions.py` splits
each kernel's instructions and stall samples into its straight-line regions (which wait the stall
samples sit at: a stage's mbarrier, a shared load).

Results, with date and device, are in benchmarks/RESULTS.md and docs/decode.md ("Status").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from bench_gemm import graph_ms, packed_weights, rotating, rotating_packed  # noqa: E402

from qtensor.ops import decode_mm as dmm  # noqa: E402


def launch(x, weight, fmt, n, k, **options):
    """One launch of the decode kernel on a (codes, scales, amax) triple, bf16 out."""
    codes, scales, amax = weight
    return dmm._launch(x, codes, scales, amax, None, fmt, n, k, 448, torch.bfloat16, **options)


def shapes(text: str):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def fit(points):
    """Least squares t = a + b * x over (x, t) points: (a, b, largest |residual|)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx
    a = mt - b * mx
    return a, b, max(abs(t - a - b * x) for x, t in points)


def fixed_cost(args) -> None:
    n, m = args.n, args.m
    series: dict[str, list[tuple[float, float]]] = {}
    print(f"# {torch.cuda.get_device_name()}, N = {n}, M = {m}: us per launch from a CUDA graph")
    print("| K | path | us | weight MB |")
    print("|---|---|---|---|")
    for k in (int(v) for v in args.ks.split(",")):
        g = torch.Generator("cuda").manual_seed(k)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        _, wb_next = rotating(lambda i: w.roll(i, 0).contiguous(), n * k * 2)
        us = graph_ms(lambda: F.linear(x, wb_next())) * 1e3
        series.setdefault("bf16 F.linear", []).append((n * k * 2 / 1e6, us))
        print(f"| {k} | bf16 F.linear | {us:.1f} | {n * k * 2 / 1e6:.1f} |")
        for fmt, (copies, nxt) in rotating_packed(w).items():
            mb = (copies[0][0].numel() + copies[0][1].numel()) / 1e6
            for pdl in (True, False):
                us = graph_ms(lambda nxt=nxt, fmt=fmt, pdl=pdl:
                              launch(x, nxt(), fmt, n, k, pdl=pdl)) * 1e3
                name = f"{fmt}{'' if pdl else ' (no overlap)'}"
                series.setdefault(name, []).append((mb, us))
                print(f"| {k} | {name} | {us:.1f} | {mb:.1f} |")
    print("\n| path | fixed cost (us) | streaming rate (TB/s) | largest residual (us) |")
    print("|---|---|---|---|")
    for name, pts in series.items():
        a, b, r = fit(pts)
        print(f"| {name} | {a:.1f} | {1 / b:.2f} | {r:.1f} |")


def own_split(x, weight, fmt, n, k, tile) -> str:
    """The K split the kernel chose, found from its bits: the split sets the order of the fp32
    sums, so the chosen launch is bitwise the forced launch of its own split and, but for a
    coincidence over every output, of no other (splits whose K ranges coincide all match)."""
    out = launch(x, weight, fmt, n, k, tile=tile)
    same = [s for s in range(1, 9)  # the kernel's splits: clusters of 1 to 8 CTAs
            if torch.equal(out, launch(x, weight, fmt, n, k, splits=s, tile=tile))]
    return "/".join(str(s) for s in same) or "none"


def splits(args) -> None:
    forced = [int(s) for s in args.splits.split(",")]
    tiles = [int(t) for t in args.tiles.split(",")]
    if any(t not in (dmm.TILE_AUTO, *dmm.TILES.values()) for t in tiles):
        raise SystemExit(f"--tiles takes 0 (chosen) and {sorted(dmm.TILES.values())}; "
                         f"got {args.tiles}")
    names = {v: name for name, v in dmm.TILES.items()} | {dmm.TILE_AUTO: "chosen"}
    print(f"# {torch.cuda.get_device_name()}: decode GEMM us by K split (0: its own choice, "
          "which the column 'own' names)")
    print("| weight | M | format | tile | own | " + " | ".join(str(s) for s in [0] + forced)
          + " |")
    print("|---|---|---|---|---|" + "---|" * (1 + len(forced)))
    for n, k in shapes(args.shapes):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for fmt, (_, nxt) in rotating_packed(w).items():
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for tile in tiles if m > 32 else [dmm.TILE_AUTO]:
                    if dmm.tile_problem(tile, fmt):
                        continue
                    cells = [own_split(x, nxt(), fmt, n, k, tile)]
                    for sp in [0] + forced:
                        us = graph_ms(lambda nxt=nxt, fmt=fmt, sp=sp, x=x, tile=tile:
                                      launch(x, nxt(), fmt, n, k, splits=sp, tile=tile)) * 1e3
                        cells.append(f"{us:.1f}")
                    print(f"| {n}x{k} | {m} | {fmt} | {names[tile]} | " + " | ".join(cells)
                          + " |", flush=True)


def times(args) -> None:
    print(f"# {torch.cuda.get_device_name()}: decode GEMM us from a CUDA graph (x bf16 F.linear, "
          "the weight's bytes a second)")
    for n, k in shapes(args.shapes):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        _, wb_next = rotating(lambda i: w.roll(i, 0).contiguous(), n * k * 2)
        packed = rotating_packed(w)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = graph_ms(lambda: F.linear(x, wb_next())) * 1e3
            cells = [f"bf16 {base:.1f} ({n * k * 2 / base / 1e6:.2f} TB/s)"]
            for fmt, (copies, nxt) in packed.items():
                us = graph_ms(lambda nxt=nxt, fmt=fmt: launch(x, nxt(), fmt, n, k)) * 1e3
                size = copies[0][0].numel() + copies[0][1].numel()  # the codes and scales
                cells.append(f"{fmt} {us:.1f} ({base / us:.2f}x, {size / us / 1e6:.2f} TB/s)")
            print(f"{n}x{k} M={m}: " + " | ".join(cells), flush=True)


def profile(args) -> None:
    for n, k in shapes(args.shapes):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed = packed_weights(w)  # one copy each: the profiler times launches alone
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if args.bf16:  # cuBLAS's kernel on the same weight: the rate to compare with
                for _ in range(3):
                    F.linear(x, w)
                torch.cuda.synchronize()
                print(f"bf16 {n}x{k} M={m}: 3 launches")
            for fmt, weight in packed.items():
                for _ in range(3):
                    launch(x, weight, fmt, n, k)
                torch.cuda.synchronize()
                print(f"{fmt} {n}x{k} M={m}: 3 launches")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fixed-cost", help="time over K, fitted into a fixed cost and a rate")
    f.add_argument("--n", type=int, default=8192)
    f.add_argument("--ks", default="1024,2048,4096,8192,16384,28672")
    f.add_argument("--m", type=int, default=1)
    s = sub.add_parser("splits", help="each forced K split against the chosen one")
    s.add_argument("--shapes", default="28672x8192,8192x28672")
    s.add_argument("--ms", default="1,16")
    s.add_argument("--splits", default="1,2,3,4,6")
    s.add_argument("--tiles", default="0",
                   help="33-64-token tiles, each a line: 0 chosen, 1 and 4 m16n8k16 (64, 128 "
                   "rows), 2 and 3 warpgroup (64, 128 rows)")
    t = sub.add_parser("times", help="each format beside bf16, a line per weight and M")
    t.add_argument("--shapes", default="8192x8192,28672x8192,8192x28672")
    t.add_argument("--ms", default="1,4,16,64")
    r = sub.add_parser("profile", help="launches alone, for Nsight Compute")
    r.add_argument("--shapes", default="28672x8192")
    r.add_argument("--ms", default="1,16")
    r.add_argument("--bf16", action="store_true",
                   help="also F.linear's bf16 kernel (widen ncu's -k filter to take it)")
    args = p.parse_args()
    run = {"fixed-cost": fixed_cost, "splits": splits, "times": times, "profile": profile}
    run[args.what](args)


if __name__ == "__main__":
    main()
