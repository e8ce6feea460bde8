"""Where a kernel's instructions go, from Nsight Compute's per-instruction SASS counters.

    ncu --clock-control none --nvtx --nvtx-include "nvfp4 col rht+sr/" --section SourceCounters \\
        --page source --print-source sass --csv python benchmarks/profile_quantize.py > src.csv
    python benchmarks/ncu_sass_regions.py src.csv --elements 134217728

The CSV may be gzipped (a name ending in .gz), as dev/gpu-pending/quant-session.sh S leaves it.

Consecutive instructions executed the same number of times form a region (a straight-line piece
of code: a loop body, a branch taken by some warps). Each region prints with its warp-level
executions, its instructions per element of the input (warp instructions x 32 / elements) and
its share of the warp-stall samples; regions below --min-share of the kernel's instructions are
left out. Each kernel's line of stall reasons gives the share of its samples each reason took
(Nsight Compute's stall_* columns, those of 2 % or more). --top N prints the N instructions with
the most samples and their two largest reasons (where a kernel waits: the instruction after a
wait is the one sampled), --dump START END the instructions between two offsets.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from dataclasses import dataclass, field


@dataclass
class Instr:
    offset: int
    sass: str
    executed: int  # warp-level executions
    samples: int   # warp-stall samples at this instruction
    reasons: dict[str, int] = field(default_factory=dict)  # samples by stall reason


def read_kernels(path: str) -> dict[str, list[Instr]]:
    """Each profiled kernel's instructions, in address order, from the CSV's per-kernel tables."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    starts = [i for i, r in enumerate(rows) if r[0] == "Kernel Name"]
    if not starts:
        raise SystemExit(f"{path}: no 'Kernel Name' table; run ncu with --page source --print-source sass --csv")
    kernels = {}
    for n, i in enumerate(starts):
        header, body = rows[i + 1], rows[i + 2:starts[n + 1] if n + 1 < len(starts) else len(rows)]
        col = {name: header.index(name) for name in
               ("Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)")}
        reasons = {h[len("stall_"):]: k for k, h in enumerate(header)
                   if h.startswith("stall_") and "(Not Issued)" not in h}
        instrs = []
        for r in body:
            if len(r) != len(header):
                continue
            instrs.append(Instr(int(r[col["Address"]], 16), r[col["Source"]].strip(),
                                int(r[col["Instructions Executed"]] or 0),
                                int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
                                {name: int(float(r[k] or 0)) for name, k in reasons.items()}))
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


def reason_shares(instrs: list[Instr], least: float = 0.0) -> list[tuple[str, float]]:
    """(reason, share of all samples) of the instructions' stall reasons, largest first."""
    totals: dict[str, int] = {}
    for ins in instrs:
        for name, n in ins.reasons.items():
            totals[name] = totals.get(name, 0) + n
    samples = sum(totals.values())
    if samples == 0:
        return []
    shares = [(name, n / samples) for name, n in totals.items() if n / samples >= least]
    return sorted(shares, key=lambda t: -t[1])


def describe(ins: Instr) -> str:
    top = sorted(ins.reasons.items(), key=lambda t: -t[1])[:2]
    why = " ".join(f"{name}:{n}" for name, n in top if n > 0)
    return f"  {ins.offset:05x} {ins.executed:8d} {ins.samples:5d}  {ins.sass:60s} {why}".rstrip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--elements", type=int, default=16384 * 8192, help="input elements of one launch")
    p.add_argument("--kernel", default="", help="only kernels whose name contains this")
    p.add_argument("--min-share", type=float, default=0.004, help="smallest share of instructions shown")
    p.add_argument("--top", type=int, default=0, help="print the N instructions with the most samples")
    p.add_argument("--dump", nargs=2, metavar=("START", "END"), help="hex offsets to print in full")
    args = p.parse_args(argv)
    for name, instrs in read_kernels(args.csv).items():
        if args.kernel not in name:
            continue
        total = sum(i.executed for i in instrs)
        samples = max(sum(i.samples for i in instrs), 1)
        if total == 0:
            continue
        print(name)
        print(f"  {total} warp instructions, {32 * total / args.elements:.2f} per element, {samples} samples")
        shares = reason_shares(instrs, 0.02)
        if shares:
            print("  stalls: " + ", ".join(f"{name} {100 * share:.1f}%" for name, share in shares))
        for first, last, executed, count, smp in regions(instrs):
            if executed * count >= args.min_share * total or smp >= 0.02 * samples:
                print(f"  {first:05x}-{last:05x}  x{executed:<8d} {count:4d} instr  "
                      f"{32 * executed * count / args.elements:5.2f}/elem  {100 * smp / samples:5.1f}% samples")
        if args.top:
            print(f"  the {args.top} instructions with the most samples:")
            for ins in sorted(instrs, key=lambda i: -i.samples)[:args.top]:
                print(describe(ins))
        if args.dump:
            lo, hi = (int(v, 16) for v in args.dump)
            for ins in instrs:
                if lo <= ins.offset <= hi:
                    print(describe(ins))


if __name__ == "__main__":
    main()
