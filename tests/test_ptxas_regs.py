"""dev/ptxas_regs.py: ptxas's per-kernel figures read from its report, and two trees compared."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
import ptxas_regs

ROOT = Path(__file__).resolve().parents[1]


def report(kernels: dict[str, tuple[int, int, int, int]], device_fn: str | None = None) -> str:
    """A `ptxas -v` report in its own layout: name -> (registers, spill stores, spill loads, smem).
    A device function's properties (no registers line) may come between entries."""
    lines = ["ptxas info    : 0 bytes gmem"]
    for name, (regs, st, ld, smem) in kernels.items():
        lines += [f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'",
                  f"ptxas info    : Function properties for {name}",
                  f"    0 bytes stack frame, {st} bytes spill stores, {ld} bytes spill loads",
                  f"ptxas info    : Used {regs} registers, used 1 barriers, {smem} bytes smem, 904 bytes cmem[0]"]
        if device_fn:
            lines += [f"ptxas info    : Function properties for {device_fn}",
                      "    24 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"]
    return "\n".join(lines) + "\n"


def test_parse_takes_each_entrys_figures_and_skips_device_functions():
    k = {"_Z1aPf": (64, 0, 0, 1056), "_Z1bPf": (71, 16, 20, 288)}
    got = ptxas_regs.parse_ptxas(report(k, device_fn="_Z6helperv"))
    assert set(got) == set(k)  # the device function is no entry
    for name, (regs, st, ld, smem) in k.items():
        assert got[name] == ptxas_regs.Kernel(regs, st, ld, smem)


def test_two_trees_list_the_kernels_that_differ_or_are_in_one_only():
    base = ptxas_regs.parse_ptxas(report({"_Z4samev": (64, 0, 0, 32), "_Z4movev": (64, 0, 0, 32),
                                          "_Z4gonev": (40, 0, 0, 0)}))
    tree = ptxas_regs.parse_ptxas(report({"_Z4samev": (64, 0, 0, 32), "_Z4movev": (71, 4, 4, 32),
                                          "_Z3newv": (50, 0, 0, 0)}))
    # c++filt names them same, move, gone and new
    n = ptxas_regs.demangle(["_Z4samev", "_Z4movev", "_Z4gonev", "_Z3newv"])
    rows = ptxas_regs.table([base, tree], ["main", "series"], show_all=False)
    body = "\n".join(rows[2:])
    assert n["_Z4samev"] not in body
    assert f"| {n['_Z4movev']} | 64 | 0 | 32 | 71 | 4/4 | 32 |" in body
    assert f"| {n['_Z4gonev']} | 40 | 0 | 0 |  |  |  |" in body
    assert f"| {n['_Z3newv']} |  |  |  | 50 | 0 | 0 |" in body
    assert all(r.count("|") == rows[0].count("|") for r in rows)
    everything = ptxas_regs.table([base, tree], ["main", "series"], show_all=True)
    assert f"| {n['_Z4samev']} | 64 | 0 | 32 | 64 | 0 | 32 |" in "\n".join(everything)
    same = ptxas_regs.table([base, base], ["main", "main"], show_all=False)
    assert same[2].startswith("| (no kernel differs) |") and same[2].count("|") == same[0].count("|")


def test_nvcc_flags_are_setup_pys():
    flags = ptxas_regs.setup_nvcc_flags(str(ROOT))
    assert "--fmad=false" in flags and "-std=c++17" in flags


def test_bad_arguments_name_the_remedy(tmp_path):
    with pytest.raises(SystemExit):
        ptxas_regs.main([str(tmp_path)])  # no csrc/quant_cuda.cu there
    with pytest.raises(SystemExit):
        ptxas_regs.main([str(ROOT)] * 3)
    (tmp_path / "setup.py").write_text("FLAGS = []\n")
    with pytest.raises(SystemExit, match="assigns no NVCC_FLAGS"):
        ptxas_regs.setup_nvcc_flags(str(tmp_path))


def test_no_cxxfilt_names_the_remedy(monkeypatch):
    monkeypatch.setattr(ptxas_regs.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match=r"no c\+\+filt on PATH .* install binutils"):
        ptxas_regs.demangle(["_Z4movev"])
