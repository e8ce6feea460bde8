"""The fused projection + quantize ops of MXFP4 QAT: one read of the weight, host bytes out.

Schemas (csrc/qat/mxfp4_qat.cpp; CPU kernel there, CUDA kernel in csrc/qat/mxfp4_qat_cuda.cu):
    qtensor::mxfp4_qat_mxfp8(Tensor w, bool direct, bool rowwise, bool columnwise)
        -> (Tensor row_qdata, Tensor row_scale, Tensor col_qdata, Tensor col_scale)
    qtensor::mxfp4_qat_fp8_block(Tensor w, bool direct) -> (Tensor qdata, Tensor scale)
An output not asked for comes back empty. The bytes are those of qtensor/qat/convert.py (the
composite-torch reference) bit for bit, in both modes; tests/test_qat_kernels.py checks it.
The implementation is chosen once per device type (qtensor.backends.qat_quant_backend),
following the project's choice (extension built, QTENSOR_QUANT_BACKEND), narrowed to the
reference where the loaded extension lacks these ops.
"""

from __future__ import annotations

import torch

from qtensor.backends import QAT_OPS, QuantBackend, has_ops, qat_quant_backend
from qtensor.formats.fp8_block import FP8BlockData
from qtensor.formats.mxfp8 import MXFP8Data
from qtensor.qat import convert


def _register_fakes() -> None:
    @torch.library.register_fake("qtensor::mxfp4_qat_mxfp8")
    def _(w, direct, rowwise, columnwise):
        n, k = w.shape
        q = torch.float8_e4m3fn
        s = torch.float8_e8m0fnu
        return (w.new_empty((n, k) if rowwise else (0,), dtype=q),
                w.new_empty((n, k // 32) if rowwise else (0,), dtype=s),
                w.new_empty((n, k) if columnwise else (0,), dtype=q),
                w.new_empty((n // 32, k) if columnwise else (0,), dtype=s))

    @torch.library.register_fake("qtensor::mxfp4_qat_fp8_block")
    def _(w, direct):
        n, k = w.shape
        return (w.new_empty((n, k), dtype=torch.float8_e4m3fn),
                w.new_empty((n // 128, k // 128), dtype=torch.float32))


if has_ops(*QAT_OPS):
    _register_fakes()


def _check(w: torch.Tensor, rows_mult: int, cols_mult: int) -> None:
    """Validate in Python before any kernel runs (the C++ checks are a second guard)."""
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(
            f"MXFP4 QAT converts bf16 or fp32 weights; got {w.dtype}. fp16 cannot hold the "
            "MXFP4 grid (2**-127 .. 6 * 2**125)."
        )
    if w.dim() != 2 or w.shape[0] % rows_mult or w.shape[1] % cols_mult:
        raise ValueError(
            f"MXFP4 QAT converts a 2-D weight [N, K] with N divisible by {rows_mult} and K by "
            f"{cols_mult} here; got shape {tuple(w.shape)}. Exclude this layer from QAT."
        )


def mxfp4_qat_mxfp8(w: torch.Tensor, direct: bool, *, rowwise: bool = True,
                    columnwise: bool = True) -> tuple[MXFP8Data | None, MXFP8Data | None]:
    """(rowwise, columnwise) MXFP8 operands of the MXFP4 projection of w [N, K]."""
    _check(w, 32 if columnwise else 1, 32)
    if qat_quant_backend(w.device.type) is QuantBackend.REFERENCE:
        row = convert.mxfp8_rowwise(w, direct) if rowwise else None
        col = convert.mxfp8_columnwise(w, direct) if columnwise else None
        return row, col
    rq, rs, cq, cs = torch.ops.qtensor.mxfp4_qat_mxfp8(w, direct, rowwise, columnwise)
    return (MXFP8Data(rq, rs) if rowwise else None), (MXFP8Data(cq, cs) if columnwise else None)


def mxfp4_qat_fp8_block(w: torch.Tensor, direct: bool) -> FP8BlockData:
    """FP8 128x128 operand of the MXFP4 projection of w [N, K]."""
    _check(w, 128, 128)
    if qat_quant_backend(w.device.type) is QuantBackend.REFERENCE:
        return convert.fp8_block_weight(w, direct)
    return FP8BlockData(*torch.ops.qtensor.mxfp4_qat_fp8_block(w, direct))


def reference_mxfp8(w, direct, rowwise=True, columnwise=True):
    """The reference outputs in the op's 4-tensor form (empty where not asked), for tests."""
    empty = torch.empty(0, dtype=torch.float8_e4m3fn, device=w.device)
    empty_s = torch.empty(0, dtype=torch.float8_e8m0fnu, device=w.device)
    row = convert.mxfp8_rowwise(w, direct) if rowwise else (empty, empty_s)
    col = convert.mxfp8_columnwise(w, direct) if columnwise else (empty, empty_s)
    return (*row, *col)
