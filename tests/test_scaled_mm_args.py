"""The scaled_mm backend's argument construction and the swizzled scale layout, on CPU.

The native call itself needs sm_100+ and is untested on hardware (docs/gemm.md); what can be
checked here is that its arguments carry exactly the reference's operands: the swizzled layout
against the offset formula of docs/formats.md, "Scale layouts" (written out independently
below), and against torchao's layout helper, and the operands decoded back from the arguments
against the unit values.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qtensor import MXFP8Tensor, NVFP4Tensor
from qtensor import backends
from qtensor.backends import GemmBackend, choice
from qtensor.formats import mxfp8, nvfp4, scale_layout
from qtensor.gemm.scaled_mm import scaled_mm_args, scaled_mm_problem, to_swizzled

SHAPES = [(128, 4), (1, 1), (200, 7), (257, 12), (64, 33)]


def _formula_swizzle(scale: torch.Tensor) -> torch.Tensor:
    """docs/formats.md, "Scale layouts": 512-byte tiles row-major over (row/128, col/4), then
    the in-tile offset."""
    rows, cols = scale.shape
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(prow * pcol, dtype=torch.uint8)
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    tile = (r // 128) * (pcol // 4) + c // 4
    offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    out[offset.reshape(-1)] = scale.view(torch.uint8).reshape(-1)
    return out


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_matches_formula_and_torchao(rows, cols):
    scale = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    flat = to_swizzled(scale)
    assert torch.equal(flat, _formula_swizzle(scale))
    blocked = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked
    assert torch.equal(flat, blocked(scale))
    assert torch.equal(from_swizzled(flat, rows, cols), scale)


def from_swizzled(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale_layout.unswizzle(flat.view(scale_layout.padded_shape(rows, cols)), rows, cols)


def test_swizzle_keeps_the_scale_dtype():
    s = torch.rand(130, 6).to(torch.float8_e4m3fn)
    flat = to_swizzled(s)
    assert flat.dtype == torch.float8_e4m3fn and flat.numel() == 256 * 8
    assert torch.equal(flat.view(torch.uint8), to_swizzled(s.view(torch.uint8)))


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without FP4 dtype")
def test_nvfp4_arguments_carry_the_reference_operands():
    m, n, k = 130, 48, 96
    a = NVFP4Tensor.from_hp(torch.randn(m, k), row_scaled=True)
    b = NVFP4Tensor.from_hp(torch.randn(n, k)).t()
    args = scaled_mm_args(a, b)
    assert args.mat_a.dtype == torch.float4_e2m1fn_x2 and args.mat_a.shape == (m, k // 2)
    assert args.mat_a.is_contiguous()
    assert args.mat_b.shape == (k // 2, n) and args.mat_b.t().is_contiguous()  # column-major
    assert args.scale_a.dtype == torch.float8_e4m3fn and args.scale_a.numel() == 256 * 8
    ua = nvfp4.unit_values(args.mat_a.view(torch.uint8), from_swizzled(args.scale_a, m, k // 16))
    ub = nvfp4.unit_values(args.mat_b.t().view(torch.uint8),
                           from_swizzled(args.scale_b, n, k // 16))
    assert torch.equal(ua, a.unit_values())
    assert torch.equal(ub.t(), b.unit_values())


def test_mxfp8_arguments_carry_the_reference_operands():
    m, n, k = 40, 64, 96
    a = MXFP8Tensor.from_hp(torch.randn(m, k))
    for b in (MXFP8Tensor.from_hp(torch.randn(n, k)).t(),  # transposed rowwise weight
              MXFP8Tensor.from_hp(torch.randn(k, n), columnwise=True)):  # row-major data
        args = scaled_mm_args(a, b)
        assert args.mat_a.dtype == torch.float8_e4m3fn and args.mat_a.is_contiguous()
        assert args.mat_b.shape == (k, n) and args.mat_b.t().is_contiguous()
        assert args.scale_b.dtype == torch.float8_e8m0fnu
        ua = mxfp8.dequantize(args.mat_a, from_swizzled(args.scale_a, m, k // 32), False)
        ub = mxfp8.dequantize(args.mat_b.t(), from_swizzled(args.scale_b, n, k // 32), False)
        assert torch.equal(ua, a.unit_values())
        assert torch.equal(ub.t(), b.unit_values())


def test_problems_are_named():
    a = MXFP8Tensor.from_hp(torch.randn(32, 64))
    b = MXFP8Tensor.from_hp(torch.randn(32, 64)).t()
    assert "CUDA" in scaled_mm_problem(a, b)
    assert "quantized in one format" in scaled_mm_problem(torch.randn(32, 64), b)


@pytest.mark.parametrize("capability,expected", [((9, 0), GemmBackend.TRITON),
                                                 ((10, 0), GemmBackend.SCALED_MM)])
def test_scaled_mm_is_never_chosen_on_hopper(monkeypatch, capability, expected):
    """Resolution with a faked device capability (no GPU needed): Hopper gets triton (or the
    emulated path where Triton is not installed, as on CI's CPU-only torch), never scaled_mm."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    backends.set_policy(backends.BackendPolicy())  # no QTENSOR_GEMM_BACKEND override
    choice._fastest_cuda_backend.cache_clear()
    try:
        if expected is GemmBackend.SCALED_MM and not hasattr(torch, "float4_e2m1fn_x2"):
            expected = GemmBackend.TRITON
        if expected is GemmBackend.TRITON and importlib.util.find_spec("triton") is None:
            expected = GemmBackend.EMULATED
        assert backends.resolve_gemm_backend("cuda:0") is expected
        problem = backends.gemm_backend_problem(GemmBackend.SCALED_MM, "cuda:0")
        assert (problem is None) == (capability >= (10, 0))
    finally:
        backends.set_policy(None)
        choice._fastest_cuda_backend.cache_clear()
