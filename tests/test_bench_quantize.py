"""benchmarks/bench_quantize.py: --cases (the rows kept, the copy always first, unknown names
refused) and --shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_quantize

# (name, fn, bytes per element, peer) as gpu_cases gives them (its cases need a GPU to build)
CASES = [("copy", None, 4, None), ("amax", None, 2, None), ("nvfp4 row", None, 2.5625, None),
         ("nvfp4 4o6 mae", None, 2.5625, "nvfp4 row")]


def test_cases_keep_the_copy_and_the_named_rows_in_the_bench_order():
    kept = bench_quantize.select_cases(CASES, ["nvfp4 4o6 mae", "nvfp4 row"])
    assert [c[0] for c in kept] == ["copy", "nvfp4 row", "nvfp4 4o6 mae"]


def test_no_cases_keeps_every_row():
    assert bench_quantize.select_cases(CASES, None) == CASES


def test_an_unknown_case_is_refused_with_the_known_rows():
    with pytest.raises(SystemExit, match=r"--cases \['nvfp4 rows'\] not among the rows \['copy', 'amax'"):
        bench_quantize.select_cases(CASES, ["nvfp4 rows"])


def test_shapes_parse_and_refuse_what_the_kernels_cannot_take():
    assert bench_quantize.parse_shapes("4096x4096, 8192X5120") == ((4096, 4096), (8192, 5120))
    for bad in ("4096", "4096x4008", "0x4096", "ax64", "4096x4096,"):
        with pytest.raises(SystemExit, match="--shapes takes MxK pairs with K a positive multiple of 32"):
            bench_quantize.parse_shapes(bad)
