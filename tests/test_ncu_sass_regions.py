"""benchmarks/ncu_sass_regions.py: regions, stall reasons and the most-stalled instructions of a
Nsight Compute source-page CSV."""

from __future__ import annotations

import csv
import gzip
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ncu_sass_regions as nsr

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_math", "stall_long_sb (Not Issued)"]


def write_csv(path: Path, kernels: dict[str, list[tuple[int, str, int, int, int, int, int]]]) -> None:
    """kernels: name -> rows of (address, sass, samples, executed, barrier, long_sb, math)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in kernels.items():
            w.writerow(["Kernel Name", name, ""])
            w.writerow(HEADER)
            for addr, sass, samples, executed, barrier, long_sb, math in rows:
                # the (Not Issued) column is a subset of the samples and must not be counted again
                w.writerow([hex(addr), sass, samples, executed, barrier, long_sb, math, long_sb])


@pytest.fixture
def two_kernels(tmp_path: Path) -> Path:
    path = tmp_path / "src.csv"
    write_csv(path, {
        "cast": [
            (0x7000, "LDS R1, [R2]", 10, 100, 0, 10, 0),
            (0x7010, "FFMA R1, R1, R1, R1", 30, 100, 0, 0, 30),
            (0x7020, "BAR.SYNC 0x0", 60, 50, 60, 0, 0),
        ],
        "other": [(0x9000, "EXIT", 0, 4, 0, 0, 0)],
    })
    return path


def test_instructions_carry_their_reasons_and_offsets_from_the_kernel_start(two_kernels: Path):
    kernels = nsr.read_kernels(str(two_kernels))
    cast = kernels["cast #0"]
    assert [i.offset for i in cast] == [0, 0x10, 0x20]
    assert cast[2].reasons == {"barrier": 60, "long_sb": 0, "math": 0}
    # regions: the two instructions executed 100 times, then the one executed 50 times
    assert nsr.regions(cast) == [(0, 0x10, 100, 2, 40), (0x20, 0x20, 50, 1, 60)]


def test_reason_shares_are_of_all_samples_largest_first(two_kernels: Path):
    cast = nsr.read_kernels(str(two_kernels))["cast #0"]
    assert nsr.reason_shares(cast) == [("barrier", 0.6), ("math", 0.3), ("long_sb", 0.1)]
    assert nsr.reason_shares(cast, least=0.2) == [("barrier", 0.6), ("math", 0.3)]
    assert nsr.reason_shares(nsr.read_kernels(str(two_kernels))["other #1"]) == []


def test_main_prints_the_stalls_and_the_top_instructions(two_kernels: Path, capsys):
    nsr.main([str(two_kernels), "--elements", "3200", "--kernel", "cast", "--top", "2"])
    out = capsys.readouterr().out
    assert "other" not in out
    assert "250 warp instructions, 2.50 per element, 100 samples" in out
    assert "stalls: barrier 60.0%, math 30.0%, long_sb 10.0%" in out
    top = out.split("the 2 instructions with the most samples:")[1].strip().splitlines()
    assert top[0].split()[:3] == ["00020", "50", "60"] and top[0].endswith("barrier:60")
    assert top[1].split()[:3] == ["00010", "100", "30"] and top[1].endswith("math:30")


def test_a_csv_without_kernel_tables_is_refused(tmp_path: Path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== nothing profiled\n")
    with pytest.raises(SystemExit, match="no 'Kernel Name' table"):
        nsr.read_kernels(str(path))


def test_a_gzipped_csv_reads_as_the_plain_one(two_kernels: Path, tmp_path: Path):
    packed = tmp_path / "src.csv.gz"
    packed.write_bytes(gzip.compress(two_kernels.read_bytes()))
    plain, unpacked = nsr.read_kernels(str(two_kernels)), nsr.read_kernels(str(packed))
    assert list(unpacked) == ["cast #0", "other #1"]
    assert unpacked == plain
