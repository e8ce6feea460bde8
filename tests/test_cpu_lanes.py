"""The SIMD-lane forms of the E4M3 / E2M1 roundings (csrc/quant_cpu_math.h, used by the CPU
kernels) against the scalar functions of csrc/quant_math.h, bit for bit, through the host
program csrc/tools/check_lanes.cpp built with the extension's compiler flags, at both codegens
of the CPU kernels' clones (baseline x86-64 and AVX2). CI runs its `sample` sweep (every
rounding boundary with every sticky state, 4M patterns per function, and the stochastic code
with all 256 random bytes; the 4over6 forms of the CUDA kernels on random blocks); `check_lanes full` runs all 2**32 fp32 patterns (docs/kernels.md)."""

import ast
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
CXX = shutil.which(os.environ.get("CXX", "c++"))
UNAVAILABLE = 77  # the program's exit code when the CPU lacks its target

pytestmark = pytest.mark.skipif(
    CXX is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C++ compiler on x86-64, as the CPU kernels' SIMD clones do",
)


def extension_flags() -> list[str]:
    """CXX_FLAGS of setup.py: the lanes are checked as the extension compiles them."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CXX_FLAGS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no CXX_FLAGS")


def build(source: Path, out: Path, codegen: str) -> Path:
    target = ["-mavx2"] if codegen == "avx2" else []
    subprocess.run([CXX, *extension_flags(), *target, "-w", str(source), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def run(binary: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), "sample"], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("codegen", ["baseline", "avx2"])
def test_lanes_equal_scalar_math(tmp_path, codegen):
    res = run(build(CSRC / "tools" / "check_lanes.cpp", tmp_path / "check", codegen))
    if res.returncode == UNAVAILABLE:
        pytest.skip(f"this CPU has no {codegen}: {res.stdout.strip()}")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = dict(line.rsplit(None, 1) for line in res.stdout.splitlines()[1:])
    assert {k.strip(): v for k, v in lines.items()} == {
        "e4m3_lanes": "equal", "e4m3_lanes (no NaN)": "equal", "e2m1_lanes": "equal",
        "e4m3_value_lanes": "equal", "e4m3_scale_value": "equal", "e2m1_code_nonan": "equal",
        "e2m1_code_fma": "equal", "e2m1_code_fma_small": "equal", "sr_group_hash": "equal",
        "sr_positions": "equal", "nv_codes_sr": "equal", "mx_inv_exponent": "equal", "e2m1_envelope_low": "equal",
        "div6": "equal", "sign_nibbles_packed": "equal", "sign_nibbles_cols": "equal",
        "fo6_block_tab": "equal", "rht_rounding_pinned": "equal"}


def run_altered(tmp_path: Path, header: str, old: str, new: str) -> subprocess.CompletedProcess:
    """check_lanes (baseline codegen) built on a copy of the headers with `old` replaced by `new`
    in `header`: a negative control's mutant."""
    (tmp_path / "tools").mkdir()
    for h in CSRC.glob("*.h"):
        shutil.copy(h, tmp_path)
    shutil.copy(CSRC / "tools" / "check_lanes.cpp", tmp_path / "tools")
    path = tmp_path / header
    text = path.read_text()
    assert old in text, f"{header} no longer holds {old!r}: update the negative control"
    path.write_text(text.replace(old, new))
    return run(build(tmp_path / "tools" / "check_lanes.cpp", tmp_path / "check", "baseline"))


def test_a_wrong_tie_rule_is_caught(tmp_path):
    """Negative control: the E4M3 lanes with ties rounded up instead of to even."""
    res = run_altered(tmp_path, "quant_cpu_math.h", "+ 0x7FFFF + ((c >> 20) & 1)) >> 20", "+ 0x7FFFF + 1) >> 20")
    assert res.returncode == 1
    assert "e4m3_lanes: pattern 0x" in res.stdout and "e2m1_lanes               equal" in res.stdout


def test_a_small_rht_error_bound_is_caught(tmp_path):
    """Negative control: the RHT's fp32 error bound a quarter of what it must be."""
    res = run_altered(tmp_path, "quant_math.h", "return u2f((fmax - 19u) << 23);", "return u2f((fmax - 21u) << 23);")
    assert res.returncode == 1
    assert "rht_sum_error_bound: run " in res.stdout and "fo6_block_tab            equal" in res.stdout
