"""Side-by-side verdicts from the tables of `benchmarks/bench_quantize.py`, over several passes.

Trees built side by side and benched one after another move every row by a few percent, the copy
included, even where their code is the same. So each row is taken over the copy's time of the same
table and shape (its time in copies), each tree's over the base tree's of the same pass, and a
change is called only where every pass agrees:

    python dev/bench_ratios.py main=p1_main.md,p2_main.md series=p1_series.md,p2_series.md

Each argument is NAME=FILE[,FILE...], the first the base; file k of every argument is pass k (the
tables measured in one GPU run). A row is "faster" (or "slower") where the tree's time in copies
is below (above) the base's by more than --margin in every pass, else "within noise"; "host" marks
a row whose host time exceeds its GPU time in some pass, which then measures the host, not the
kernel. Two passes call changes of a few percent poorly: on 2026-12-06 rows whose code had not
changed moved 1-3 % in both of two passes. Below about 3 %, take more passes, the CUDA graph's
times (`--time gpu`: the kernels alone, without the launches' host time; on 2026-12-07 their
ratios spread over three passes 0.5-0.6 times as wide as the eager ones), or Nsight Compute's
times at locked clocks (`ncu --clock-control base`; at base clocks an instruction-bound kernel
can rank otherwise than at the clocks it runs at).
"""

from __future__ import annotations

import argparse
import re
import sys

Row = tuple[str, str]  # shape, kernel


def parse_table(text: str, source: str = "table") -> dict[Row, tuple[float, float, float]]:
    """Rows of one bench table: (shape, kernel) -> (us, GPU us, host us)."""
    rows: dict[Row, tuple[float, float, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or not re.fullmatch(r"\d+x\d+", cells[0]):
            continue
        try:
            us, gpu, host = float(cells[2]), float(cells[6]), float(cells[7])
        except ValueError:  # a failed or uncaptured case has no numbers
            continue
        rows[(cells[0], cells[1])] = (us, gpu, host)
    if not rows:
        raise ValueError(f"{source}: no rows of a bench_quantize table (| shape | kernel | us | ... | host us |)")
    return rows


TIMES = {"us": 0, "gpu": 1}  # --time: the eager calls' time, or the CUDA graph's (kernels alone)


def in_copies(rows: dict[Row, tuple[float, float, float]], source: str, time: str = "us") -> dict[Row, float]:
    """Each row's time (`time`: "us" or "gpu") over the copy's of the same shape in the same table."""
    col = TIMES[time]
    out = {}
    for (shape, kernel), times in rows.items():
        copy = rows.get((shape, "copy"))
        if copy is None:
            raise ValueError(f"{source}: shape {shape} has no copy row to take its rows over; "
                             "bench_quantize.py measures one first for every shape")
        out[(shape, kernel)] = times[col] / copy[col]
    return out


def verdicts(groups: list[tuple[str, list[str]]], texts: dict[str, str], margin: float,
             time: str = "us") -> list[str]:
    """The markdown lines of the comparison of every group with the first, pass by pass."""
    passes = {len(files) for _, files in groups}
    if len(passes) != 1:
        raise ValueError(f"every tree needs the same number of passes (file k is pass k); got "
                         f"{', '.join(f'{n}: {len(f)}' for n, f in groups)}")
    tables = {name: [parse_table(texts[f], f) for f in files] for name, files in groups}
    copies = {name: [in_copies(t, f, time) for t, f in zip(tables[name], files)] for name, files in groups}
    base = groups[0][0]
    what = "time in copies" if time == "us" else "GPU time in copies"
    head = ["shape", "kernel", f"{base} ({what})"] + [f"{n} / {base}" for n, _ in groups[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in tables[base][0]:
        if row[1] == "copy" or any(row not in c for c in copies[base]):
            continue  # a row the base did not run in every pass (`--cases`) has nothing to compare
        host = any(t[row][2] > t[row][1] for name, _ in groups for t in tables[name] if row in t)
        mark = " (host)" if host else ""
        cells = [row[0], row[1] + mark, " / ".join(f"{c[row]:.3f}" for c in copies[base])]
        for name, _ in groups[1:]:
            if any(row not in c for c in copies[name]):
                cells.append("missing")
                continue
            rel = [c[row] / b[row] for c, b in zip(copies[name], copies[base])]
            if all(r < 1 - margin for r in rel):
                word = "faster"
            elif all(r > 1 + margin for r in rel):
                word = "slower"
            else:
                word = "within noise"
            cells.append(" / ".join(f"{r:.3f}" for r in rel) + f" {word}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", metavar="NAME=FILE[,FILE...]", help="the base first")
    p.add_argument("--margin", type=float, default=0.02,
                   help="the least relative change every pass must show (default 0.02)")
    p.add_argument("--time", choices=sorted(TIMES), default="us",
                   help="us: the eager calls' time (default); gpu: the CUDA graph replay's, the "
                        "kernels alone, without the launches' host time")
    args = p.parse_args(argv)
    groups = []
    for spec in args.trees:
        name, sep, files = spec.partition("=")
        if not sep or not name or not files:
            p.error(f"a tree is NAME=FILE[,FILE...]; got {spec!r}")
        groups.append((name, files.split(",")))
    if len(groups) < 2:
        p.error("give the base tree and at least one more")
    texts = {}
    for _, files in groups:
        for f in files:
            with open(f) as fh:
                texts[f] = fh.read()
    try:
        print("\n".join(verdicts(groups, texts, args.margin, args.time)))
    except ValueError as e:
        print(f"bench_ratios: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
