"""The two host recipes of MXFP4 QAT: how each quantizes an operand for a role and multiplies two.

[Note: host operands]
An `Operand` is the bytes of one GEMM operand: E4M3 `qdata` in the tensor's logical layout and
its scales, with `layout` naming the block shape and direction:
    "mx_row"  1x32 UE8M0 blocks along the last dim      scale [M, K/32]     (MXFP8 host)
    "mx_col"  32x1 blocks along dim 0                    scale [M/32, K]
    "fb_row"  1x128 fp32 power-of-two blocks, last dim   scale [M, K/128]    (FP8 block host)
    "fb_col"  1x128 blocks along dim 0                   scale [M/128, K]
    "fb_tile" 128x128 tiles (weights)                    scale [N/128, K/128]
`.t()` transposes the view without touching bytes (row <-> col, a tile stays a tile). A GEMM
`mm(a, b)` = a [M, K] @ b [K, N] needs a's blocks along its last dim and b's along dim 0, the
same convention as qtensor/gemm/dense.py.

Backends, chosen once per device (`gemm_backend`): EMULATED multiplies the exact decoded values
through the GEMM ops (`mm`; every platform, exact up to fp32 summation order); SCALED_MM, opt-in
(MXFP4QATConfig.native_gemm), runs the FP8 block host natively through torch._scaled_mm on
sm_90+ (1x128 x 128x128 for fprop and dgrad, 1x128 x 1x128 for wgrad); on the H200 it does not
yet match the emulation (docs/qat.md, Status). The MXFP8 host has no native GEMM on Hopper
(block-scaled MX needs sm_100) and stays emulated there.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from qtensor.backends import GemmBackend, ScaledMMFormat, qat_gemm_backend
from qtensor.formats import fp8_block, mxfp8
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.ops import gemm_ops, quant
from qtensor.ops.gemm_operands import MXFP8, Side, apply_epilogue


class Host(str, enum.Enum):
    MXFP8 = "mxfp8"  # E4M3 data, one UE8M0 scale per 1x32 block, every role
    FP8_BLOCK128 = "fp8_block128"  # 1x128 activations/gradients, 128x128 weights, fp32 scales


_FLIP = {"mx_row": "mx_col", "mx_col": "mx_row", "fb_row": "fb_col", "fb_col": "fb_row",
         "fb_tile": "fb_tile"}
_FB_SPECS = {"fb_row": FP8BlockSpec("1x128"), "fb_col": FP8BlockSpec("1x128", columnwise=True),
             "fb_tile": FP8BlockSpec("128x128")}


@dataclasses.dataclass(frozen=True)
class Operand:
    qdata: torch.Tensor  # float8_e4m3fn, logical layout [rows, cols]
    scale: torch.Tensor  # float8_e8m0fnu (mx_*) or float32 (fb_*), see the note
    layout: str  # one of _FLIP's keys

    def t(self) -> "Operand":
        return Operand(self.qdata.t(), self.scale.t(), _FLIP[self.layout])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact decoded values (fp32 holds every e4m3 * 2**k exactly)."""
        if self.layout.startswith("mx"):
            return mxfp8.dequantize(self.qdata, self.scale, self.layout == "mx_col", dtype)
        return fp8_block.dequantize(self.qdata, self.scale, _FB_SPECS[self.layout], dtype)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qdata, self.scale


def quantize(x: torch.Tensor, host: Host, columnwise: bool) -> Operand:
    """An activation or gradient operand: rowwise (blocks along the last dim) or columnwise.
    MXFP8 goes through the quantization dispatch point (the C++ / CUDA kernels, bytes equal to
    the reference); FP8 128x128 blocks have only the reference."""
    if host is Host.MXFP8:
        (q, s), _ = quant.quantize_mxfp8(x, MXFP8Spec(columnwise=columnwise))
        return Operand(q, s, "mx_col" if columnwise else "mx_row")
    layout = "fb_col" if columnwise else "fb_row"
    q, s = fp8_block.quantize(x, _FB_SPECS[layout])
    return Operand(q, s, layout)


def token_multiple(host: Host) -> int:
    """Rows (tokens) a columnwise activation/gradient needs to be a multiple of."""
    return mxfp8.BLOCK if host is Host.MXFP8 else fp8_block.BLOCK


# The native GEMM of each host: the FP8 block host's runs torch._scaled_mm on fp32 block scales
# (sm_90+); the MXFP8 host has none wired here (block-scaled MX would need sm_100).
_NATIVE_FORMAT = {Host.MXFP8: None, Host.FP8_BLOCK128: ScaledMMFormat.FP8_BLOCK128}


def gemm_backend(host: Host, device: torch.device, native: bool = False) -> GemmBackend:
    """Chosen once per (host, device, native): the native FP8 block GEMM when asked for on
    sm_90+, else exact emulation (qtensor.backends.qat_gemm_backend). `native` is opt-in
    (MXFP4QATConfig.native_gemm) until the torch._scaled_mm scale layouts are verified on the
    GPU machine (docs/qat.md, status)."""
    return qat_gemm_backend(_NATIVE_FORMAT[host], device, native)


def mm(a: Operand, b: Operand, out_dtype: torch.dtype, backend: GemmBackend,
       bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias in fp32) cast to out_dtype.

    EMULATED products run through the GEMM ops (qtensor/ops/gemm_ops.py), fed b as rows along
    K (b.t(), a view): the MXFP8 host through qtensor::mxfp8_mm (the Triton GEMM on CUDA, the
    exact reference elsewhere), the FP8 block host through qtensor::fp8_block_mm (its exact
    reference on every device). Both are opaque ops, so a compiled step multiplies exactly as
    the eager one does."""
    mx = a.layout == "mx_row"
    if a.layout not in ("mx_row", "fb_row") or b.layout not in (
            ("mx_col",) if mx else ("fb_col", "fb_tile")):
        raise ValueError(
            f"mm needs a rowwise left operand and a columnwise or tile right operand of the same "
            f"host; got {a.layout} x {b.layout}."
        )
    if backend is GemmBackend.SCALED_MM:
        acc = _scaled_mm_block(a, b, torch.float32 if bias is not None else out_dtype)
        return apply_epilogue(acc, None, None, bias, out_dtype)
    rows = b.t()
    if mx:
        args = gemm_ops.dense_args(MXFP8, Side(a.qdata, a.scale), Side(rows.qdata, rows.scale),
                                   bias, out_dtype)
        return gemm_ops.call("mxfp8_mm", *args)
    return gemm_ops.call("fp8_block_mm", a.qdata, a.scale, rows.qdata, rows.scale,
                         rows.layout == "fb_tile", bias, out_dtype)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _scaled_mm_block(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with DeepSeek-style block scales.

    The shape checks in ATen: a row-major with 1x128 scales (M, K/128) in column-major strides;
    b column-major. A 128x128 b = W.t() takes W's tile scales (N/128, K/128) in column-major
    strides (1, N/128), the layout reported to run on the H200 at full speed; a 1x128 b takes its
    (K/128, N) scales row-major, the same memory as (N, K/128) column-major. On the H200 with
    torch 2.11 (two scale layouts tried) the products still differ from the emulation
    (tests/test_qat_kernels.py, xfail), so this path stays opt-in (native_gemm=True).
    """
    scale_b = _col_major(b.scale.t()) if b.layout == "fb_tile" else b.scale.contiguous()
    return torch._scaled_mm(
        a.qdata.contiguous(),
        _col_major(b.qdata),
        scale_a=_col_major(a.scale),
        scale_b=scale_b,
        out_dtype=out_dtype,
    )
