"""Writes to a wgmma's A registers while it may still read them, found in the SASS.

    python csrc/tools/wgmma_a_hazards.py OBJECT.o [NAME_PATTERN]

wgmma (HGMMA in SASS) reads A from registers asynchronously, until the warpgroup wait that
completes it. ptxas does not keep those registers from reuse once the HGMMA has issued: the
decode GEMM's warpgroup tile once loaded the next activation and integer temporaries into them
(wrong sums, sometimes inf). The kernel code keeps them live with a fence after the wait; this
tool checks the machine code. It follows each kernel's instructions in order (straight-line,
which holds for the unrolled consumer loop), marks the A registers of every HGMMA pending, clears
them at `WARPGROUP.DEPBAR.LE gsb0, 0x0`, and reports an instruction that writes a pending
register. Needs cuobjdump (and nvdisasm) on PATH.

It also prints, per kernel, how many instructions stand between each group of HGMMAs (the one
that carries `gsb0`) and the wait that completes it, fewest and median: what the warp issues
while its MMAs run. ptxas moves arithmetic across the wait: in the decode GEMM's warpgroup tile
with one B set it put the wait before the decode that the source places ahead of it, so that
only the stages' barriers and the weight's loads (about 30 instructions) overlapped the MMAs;
with two sets the decode and its stores do (about 120; Nsight Compute's SASS on an H100).
"""

from __future__ import annotations

import re
import subprocess
import sys

NO_DEST = ("ST", "BAR", "HGMMA", "WARPGROUP", "SYNCS", "BRA", "EXIT", "RED", "ATOM", "NOP")


def functions(obj: str) -> dict[str, list[str]]:
    out = subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True,
                         check=True).stdout
    funcs: dict[str, list[str]] = {}
    name = None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", line)
        if m and name:
            funcs[name].append(m.group(1).strip())
    return funcs


def hazards(ins: list[str]) -> list[str]:
    found, pending = [], set()
    for t in ins:
        if "WARPGROUP.DEPBAR" in t and t.rstrip().endswith("0x0"):
            pending = set()
            continue
        m = re.match(r"(@!?U?P\w+\s+)?HGMMA\S*\s+R(\d+),\s+R(\d+),", t)
        if m:
            a = int(m.group(3))
            pending |= set(range(a, a + 4))
            continue
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+R(\d+)\S*,", t)
        if m and not m.group(2).startswith(NO_DEST):
            op = m.group(2)  # a register pair: 64-bit loads and moves, IMAD.WIDE's product
            width = 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op else 1
            if pending & set(range(int(m.group(3)), int(m.group(3)) + width)):
                found.append(t)
    return found


def overlaps(ins: list[str]) -> list[int]:
    """Instructions between each HGMMA group's last instruction (`gsb0`) and the next wait."""
    counts, since = [], None
    for t in ins:
        if "WARPGROUP.DEPBAR" in t:
            if since is not None:
                counts.append(since)
            since = None
        elif re.match(r"(@!?U?P\w+\s+)?HGMMA\S*\s", t) and "gsb0" in t:
            since = 0
        elif since is not None and not t.startswith("NOP"):
            since += 1
    return counts


def main() -> int:
    obj, pattern = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "HGMMA"
    bad = 0
    for name, ins in functions(obj).items():
        if not any("HGMMA" in t for t in ins) or not re.search(pattern, name + " HGMMA"):
            continue
        found = hazards(ins)
        bad += len(found)
        gaps = sorted(overlaps(ins))
        between = (f"{gaps[0]} / {gaps[len(gaps) // 2]} instructions (fewest / median) between an "
                   "MMA group and its wait" if gaps else "no MMA group followed by a wait")
        print(f"{name}: {len(found)} writes to pending A registers; {between}")
        for t in found[:3]:
            print(f"    {t}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
