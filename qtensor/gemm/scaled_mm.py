"""The `scaled_mm` GEMM backend: native block-scaled torch._scaled_mm on sm_100+ (NVFP4,
MXFP8), and on sm_90+ for FP8 with 1x128 / 128x128 fp32 block scales (FP8BlockTensor).

The NVFP4 / MXFP8 calls are untested on hardware: the project's GPU machines are Hoppers (sm_90),
which have no block-scaled FP4/MX tensor cores, and this backend is never selected there
(qtensor.backends). What is tested (on CPU) is their argument construction: operand views,
column-major right operand, swizzled scales (docs/formats.md, "Scale layouts";
qtensor/formats/scale_layout.py) checked against torchao's layout helper. The FP8 block call runs
on sm_90 and is tested there against the emulation (tests/test_qat_kernels.py).

The call returns the fp32 block-scaled product `sum_k units_a * units_b` (what the emulated
reference's matmul computes); the per-tensor factors, row scaling, bias and cast are then the
shared epilogue of qtensor/gemm/dense.py, in the reference's order. torch._scaled_mm's own
`scale_result`/bias are not used: they would reorder the epilogue.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qtensor.backends import QuantBackend
from qtensor.formats import scale_layout
from qtensor.ops import fp8_block as fp8_block_op
from qtensor.ops import quant
from qtensor.tensors.base import QuantizedTensor


class ScaledMMArgs(NamedTuple):
    mat_a: torch.Tensor  # [M, K/2] float4_e2m1fn_x2 or [M, K] float8_e4m3fn, row-major
    mat_b: torch.Tensor  # [K/2, N] or [K, N], column-major
    scale_a: torch.Tensor  # flat swizzled float8_e4m3fn (NVFP4) or float8_e8m0fnu (MXFP8)
    scale_b: torch.Tensor


def scaled_mm_problem(a_op, b_op, bias=None) -> str | None:
    """Why the native call cannot run this product, or None."""
    if not (isinstance(a_op, QuantizedTensor) and type(a_op) is type(b_op)):
        return "both operands must be quantized in one format"
    if b_op.gemm_format == "fp8_block":
        return _fp8_block_problem(a_op, b_op, bias)
    if b_op.gemm_format not in ("nvfp4", "mxfp8"):
        return f"no block-scaled GEMM for {type(b_op).__name__}"
    if a_op.dim() != 2 or b_op.dim() != 2:
        return "torch._scaled_mm takes 2-D operands"
    if a_op.device.type != "cuda":
        return "torch._scaled_mm runs on CUDA"
    # cuBLAS wants 16-byte aligned leading dims: K/2 bytes (NVFP4) or K bytes (MXFP8), and N.
    k, n = a_op.shape[1], b_op.shape[1]
    if k % 32 or n % 16:
        return f"K must be a multiple of 32 and N of 16; got K={k}, N={n}"
    if bias is not None and bias.dim() != 1:
        return "bias must be 1-D"
    return None


def to_swizzled(scale: torch.Tensor) -> torch.Tensor:
    """Compact [rows, cols] scales -> the flat swizzled buffer torch._scaled_mm takes: the
    kernels' swizzle op where they are built for this device, else the reference."""
    if quant.quant_backend(scale.device) is QuantBackend.REFERENCE:
        return scale_layout.swizzle(scale).reshape(-1)
    return quant.swizzle_scale(scale).reshape(-1)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.t().is_contiguous() else t.t().contiguous().t()


def scaled_mm_args(a_op, b_op) -> ScaledMMArgs:
    """Arguments of torch._scaled_mm for a rowwise left and a columnwise right operand."""
    if a_op.gemm_format == "nvfp4":
        fp4 = torch.float4_e2m1fn_x2
        # Columnwise storage [N, K/2] is B^T row-major, so its .t() is B column-major.
        return ScaledMMArgs(
            a_op.qdata.contiguous().view(fp4),
            b_op.qdata.contiguous().view(fp4).t(),
            to_swizzled(a_op.scale),  # [M, K/16]
            to_swizzled(b_op.scale),  # [N, K/16]
        )
    return ScaledMMArgs(
        a_op.qdata.contiguous(),
        _column_major(b_op.qdata),  # [K, N]
        to_swizzled(a_op.scale),  # [M, K/32]
        to_swizzled(b_op.scale.t()),  # [K/32, N] -> [N, K/32]
    )


# ---- FP8 with fp32 block scales (DeepSeek-style; the FP8 block host of MXFP4 QAT) ------------


def _fp8_block_problem(a_op, b_op, bias) -> str | None:
    if a_op.dim() != 2 or b_op.dim() != 2:
        return "torch._scaled_mm takes 2-D operands"
    if a_op.device.type != "cuda":
        return "torch._scaled_mm runs on CUDA"
    if a_op.block != "1x128":
        return "the left operand must have 1x128 blocks"
    if b_op.shape[1] % 16:
        return f"cuBLAS needs N a multiple of 16 (aligned output rows); got N={b_op.shape[1]}"
    if bias is not None and bias.dim() != 1:
        return "bias must be 1-D"
    return None


def fp8_block_scaled_mm(a_op, b_op, bias, out_dtype) -> torch.Tensor:
    """a [M, K] (1x128 rowwise) @ b [K, N] (128x128 tiles, or 1x128 along K) through
    qtensor::fp8_block_scaled_mm (qtensor/ops/fp8_block.py): torch._scaled_mm with fp32 block
    scales, + bias in fp32, the cast.

    The products of E4M3 values and power-of-two scales are exact; cuBLAS sums each 128-element
    K block on the FP8 tensor cores, whose accumulator keeps fewer bits than fp32 on sm_90, and
    the blocks in fp32: the result differs from the emulation by a few 1e-4 of the output's
    largest magnitude (docs/qat.md; tests/test_qat_kernels.py states the bound).
    """
    a_data, a_scale, *_ = a_op.gemm_rows(True)
    b_data, b_scale, *_ = b_op.gemm_rows(False)  # rows along K: [N, K]
    return fp8_block_op.fp8_block_scaled_mm(a_data, a_scale, b_data, b_scale,
                                            b_op.block == "128x128", bias, out_dtype)
