"""Shared fixtures and helpers for the qtensor test suite.

The golden vectors (tests/data/golden_formats_v1.pt) were computed by a second implementation of
the formats, written independently of qtensor; `NVFP4_GOLDEN_SPECS` and `MXFP8_GOLDEN_SPECS` name
the spec each of their configurations stands for (tests/data/README.md lists the keys).
Helpers that tests import live here too (`from conftest import ...`): pytest puts this folder on
sys.path before it collects the test modules.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from qtensor.formats.mxfp8 import MXFP8Spec  # noqa: E402
from qtensor.formats.nvfp4 import NVFP4Spec  # noqa: E402
from qtensor.tensors import QuantizedTensor  # noqa: E402

GOLDEN_PATH = ROOT / "tests" / "data" / "golden_formats_v1.pt"

GOLDEN_INPUTS = (
    "bf16_all_finite",
    "ties",
    "normal_rowspread",
    "outlier",
    "zero_blocks",
    "all_zero",
    "fp32_wide",
)

NVFP4_GOLDEN_SPECS = {
    "nvfp4": NVFP4Spec(),
    "nvfp4_col": NVFP4Spec(columnwise=True),
    "nvfp4_2d": NVFP4Spec(block_2d=True),
    "nvfp4_rowscaled": NVFP4Spec(row_scaled=True),
    "nvfp4_rowscaled_col": NVFP4Spec(row_scaled=True, columnwise=True),
    "nvfp4_b256": NVFP4Spec(e4m3_bound=256),
    "nvfp4_4o6_mae_b256": NVFP4Spec(fourover6="mae", e4m3_bound=256),
    "nvfp4_4o6_mse_b256": NVFP4Spec(fourover6="mse", e4m3_bound=256),
    "nvfp4_4o6_mae_b448": NVFP4Spec(fourover6="mae", e4m3_bound=448),
    "nvfp4_4o6_mse_2d_b256": NVFP4Spec(fourover6="mse", block_2d=True, e4m3_bound=256),
}

MXFP8_GOLDEN_SPECS = {
    "mxfp8_rceil": MXFP8Spec("rceil"),
    "mxfp8_floor": MXFP8Spec("floor"),
    "mxfp8_rceil_col": MXFP8Spec("rceil", columnwise=True),
    "mxfp8_floor_col": MXFP8Spec("floor", columnwise=True),
}

# E2M1 magnitudes of codes 0..7 (bit 3 is the sign), written out here independently of
# qtensor.formats.elements so decode checks do not lean on the code under test.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def kernel_devices() -> list:
    """Devices of the compiled-kernel tests (csrc/): cpu, and cuda marked `cuda` and skipped
    unless the extension holds CUDA kernels. A function, so that collecting other test files
    does not load the extension."""
    from qtensor.backends import has_kernel

    has_cuda_kernels = torch.cuda.is_available() and has_kernel("nvfp4_quantize", "CUDA")
    skip = pytest.mark.skipif(not has_cuda_kernels, reason="no CUDA kernels")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, skip])]


@pytest.fixture
def setenv(monkeypatch):
    """setenv(name, value) for QTENSOR_* variables: qtensor reads the process environment once
    (qtensor/backends/env.py), so each change makes the next use read it again, and the end of
    the test restores the variables and reads them again too."""
    from qtensor.backends import set_policy

    def set_variable(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        set_policy(None)  # forgets the policy and the environment read so far

    yield set_variable
    monkeypatch.undo()
    set_policy(None)


@pytest.fixture(scope="session")
def golden() -> dict[str, torch.Tensor]:
    return torch.load(GOLDEN_PATH, weights_only=True)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a 1-byte tensor (uint8, float8_*) as uint8, contiguous."""
    if t.element_size() != 1:
        raise TypeError(f"as_bytes takes a 1-byte dtype; got {t.dtype}")
    return t.contiguous().view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = as_bytes(actual), as_bytes(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} bytes differ; first at {bad[0].tolist()}: "
            f"{a[tuple(bad[0])].item():#04x} != {e[tuple(bad[0])].item():#04x}"
        )


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality of two float tensors (so -0.0 != +0.0 and NaN payloads count)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    view = int_dtype[actual.element_size()]
    a, e = actual.contiguous().view(view), expected.contiguous().view(view)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        i = tuple(bad[0])
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} values differ; first at {list(i)}: "
            f"{actual[i].item()!r} != {expected[i].item()!r}"
        )


def leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind t: the inner tensors of a (nested) quantized tensor, in
    declaration order and without the absent (None) ones; a plain tensor is its own leaf."""
    if not isinstance(t, QuantizedTensor):
        return [t]
    return [leaf for n in t.tensor_data_names if (inner := getattr(t, n)) is not None
            for leaf in leaves(inner)]


def all_bf16_patterns() -> torch.Tensor:
    """Every one of the 65,536 bf16 bit patterns, in bit order, as a flat bf16 tensor."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] E2M1 codes; element 2j is the low nibble (written here on
    purpose, not imported, so the packing convention is checked independently)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e2m1_values(codes: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=dtype)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum()))
