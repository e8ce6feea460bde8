"""Where a kernel's instructions go, from Nsight Compute's per-instruction SASS counters.

    ncu --clock-control none --nvtx --nvtx-include "nvfp4 col rht+sr/" --section SourceCounters \\
        --page source --print-source sass --csv python benchmarks/profile_quantize.py > src.csv
    python benchmarks/ncu_sass_regions.py src.csv --elements 134217728

Consecutive instructions executed the same number of times form a region (a straight-line piece
of code: a loop body, a branch taken by some warps). Each region prints with its warp-level
executions, its instructions per element of the input (warp instructions x 32 / elements) and
its share of the warp-stall samples; regions below --min-share of the kernel's instructions are
left out. --dump START END prints the instructions between two offsets with their counts.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass


@dataclass
class Instr:
    offset: int
    sass: str
    executed: int  # warp-level executions
    samples: int   # warp-stall samples at this instruction


def read_kernels(path: str) -> dict[str, list[Instr]]:
    """Each profiled kernel's instructions, in address order, from the CSV's per-kernel tables."""
    rows = [r for r in csv.reader(open(path, newline="")) if r]
    starts = [i for i, r in enumerate(rows) if r[0] == "Kernel Name"]
    if not starts:
        raise SystemExit(f"{path}: no 'Kernel Name' table; run ncu with --page source --print-source sass --csv")
    kernels = {}
    for n, i in enumerate(starts):
        header, body = rows[i + 1], rows[i + 2:starts[n + 1] if n + 1 < len(starts) else len(rows)]
        col = {name: header.index(name) for name in
               ("Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)")}
        instrs = []
        for r in body:
            if len(r) != len(header):
                continue
            instrs.append(Instr(int(r[col["Address"]], 16), r[col["Source"]].strip(),
                                int(r[col["Instructions Executed"]] or 0),
                                int(r[col["Warp Stall Sampling (All Samples)"]] or 0)))
        if instrs:
            base = instrs[0].offset
            for ins in instrs:
                ins.offset -= base
            kernels[f"{rows[i][1]} #{n}"] = instrs
    return kernels


def regions(instrs: list[Instr]) -> list[tuple[int, int, int, int, int]]:
    """(first offset, last offset, executions, instructions, samples) of each region."""
    out: list[list[int]] = []
    for ins in instrs:
        if out and out[-1][2] == ins.executed:
            out[-1][1] = ins.offset
            out[-1][3] += 1
            out[-1][4] += ins.samples
        else:
            out.append([ins.offset, ins.offset, ins.executed, 1, ins.samples])
    return [tuple(r) for r in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--elements", type=int, default=16384 * 8192, help="input elements of one launch")
    p.add_argument("--kernel", default="", help="only kernels whose name contains this")
    p.add_argument("--min-share", type=float, default=0.004, help="smallest share of instructions shown")
    p.add_argument("--dump", nargs=2, metavar=("START", "END"), help="hex offsets to print in full")
    args = p.parse_args()
    for name, instrs in read_kernels(args.csv).items():
        if args.kernel not in name:
            continue
        total = sum(i.executed for i in instrs)
        samples = max(sum(i.samples for i in instrs), 1)
        if total == 0:
            continue
        print(name)
        print(f"  {total} warp instructions, {32 * total / args.elements:.2f} per element, {samples} samples")
        for first, last, executed, count, smp in regions(instrs):
            if executed * count >= args.min_share * total or smp >= 0.02 * samples:
                print(f"  {first:05x}-{last:05x}  x{executed:<8d} {count:4d} instr  "
                      f"{32 * executed * count / args.elements:5.2f}/elem  {100 * smp / samples:5.1f}% samples")
        if args.dump:
            lo, hi = (int(v, 16) for v in args.dump)
            for i in instrs:
                if lo <= i.offset <= hi:
                    print(f"  {i.offset:05x} {i.executed:8d} {i.samples:5d}  {i.sass}")


if __name__ == "__main__":
    main()
