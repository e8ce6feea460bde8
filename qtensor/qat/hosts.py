"""The two host recipes of MXFP4 QAT, as operand specs of the training roles, and the weight
transform that feeds them.

[Note: QAT hosts]
A host is the recipe the GEMMs of a QAT step run in. Each is an `OperandSpecs` of the training
stack (qtensor/training/roles.py), so the activations and gradients are quantized and multiplied
exactly as a training recipe's are (`quantize_role`, `fprop`/`dgrad`/`wgrad` through
qtensor/gemm/dense.py):
    MXFP8         input, grad_output: MXFP8 1x32 rowwise + 32x1 columnwise (RCEIL)
    FP8_BLOCK128  input, grad_output: FP8 1x128 rowwise + 1x128 along dim 0; fp32 pow2 scales
Only the weight differs: its operand is not `quantize_role(W)` but the MXFP4 projection of W in
the host's bytes (`weight_operand`, the fused ops of kernels.py, reference convert.py):
    MXFP8         HybridTensor: rowwise MXFP8 of w^ + columnwise MXFP8 (a fresh 32x1
                  quantization of w^); the rowwise side alone under a backward override
    FP8_BLOCK128  FP8BlockTensor of 128x128 tiles: one tensor for fprop and dgrad (a square tile
                  transposes exactly)
The weight's RoleSpec records those usages (the OperandSpecs checks pair them with the others).

GEMM backends, chosen once per device (`gemm_backend`): EMULATED multiplies the exact decoded
values through the GEMM ops (every platform, exact up to fp32 summation order; the reference);
SCALED_MM, opt-in (MXFP4QATConfig.native_gemm), runs the FP8 block host natively through
torch._scaled_mm on sm_90+ (qtensor/gemm/scaled_mm.py; 1x128 x 128x128 for fprop and dgrad,
1x128 x 1x128 for wgrad), within a stated bound of the emulation (docs/qat.md, Status). The
MXFP8 host has no native GEMM on Hopper (block-scaled MX needs sm_100) and stays emulated there.
"""

from __future__ import annotations

import enum

import torch

from qtensor.backends import GemmBackend, ScaledMMFormat, qat_gemm_backend, qat_quant_backend
from qtensor.formats import fp8_block, mxfp8
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.qat import kernels
from qtensor.tensors import FP8BlockTensor, HybridTensor, MXFP8Tensor, QuantizedTensor
from qtensor.training.roles import OperandSpecs, RoleSpec


class Host(str, enum.Enum):
    MXFP8 = "mxfp8"  # E4M3 data, one UE8M0 scale per 1x32 block, every role
    FP8_BLOCK128 = "fp8_block128"  # 1x128 activations/gradients, 128x128 weights, fp32 scales


_ROWS = {Host.MXFP8: MXFP8Spec(), Host.FP8_BLOCK128: FP8BlockSpec("1x128")}
_COLUMNS = {Host.MXFP8: MXFP8Spec(columnwise=True),
            Host.FP8_BLOCK128: FP8BlockSpec("1x128", columnwise=True)}
_WEIGHT = {Host.MXFP8: RoleSpec(MXFP8Spec(), MXFP8Spec(columnwise=True)),
           Host.FP8_BLOCK128: RoleSpec(FP8BlockSpec("128x128"))}


def operand_specs(host: Host, backward_override: str | None) -> OperandSpecs:
    """The host as the training roles' specs: both usages of the input and grad_output, or the
    input's rowwise one alone when a backward override runs the backward in high precision."""
    if backward_override is not None:
        weight = RoleSpec(_WEIGHT[host].rowwise)
        return OperandSpecs(RoleSpec(_ROWS[host]), weight, RoleSpec(None), backward_override)
    both = RoleSpec(_ROWS[host], _COLUMNS[host])
    return OperandSpecs(both, _WEIGHT[host], both)


def weight_operand(weight: torch.Tensor, config, backend: GemmBackend) -> QuantizedTensor:
    """The weight's operand under `config`: its MXFP4 projection in the host's bytes
    (projection or direct conversion, the fused kernel where it is built), with the usages the
    backward needs ([Note: QAT hosts])."""
    w = weight.detach()
    host, direct = Host(config.host), config.direct
    need_dgrad = config.backward_override is None
    made_by = qat_quant_backend(w.device.type)
    if host is Host.MXFP8:
        row, col = kernels.mxfp4_qat_mxfp8(w, direct, rowwise=True, columnwise=need_dgrad)
        row_t = MXFP8Tensor.wrap(w, MXFP8Spec(), row, made_by)
        if not need_dgrad:
            return row_t
        col_t = MXFP8Tensor.wrap(w, MXFP8Spec(columnwise=True), col, made_by)
        # "original": the columnwise bytes quantize w^ itself, not the rowwise side decoded.
        return HybridTensor(w.shape, w.dtype, w.device, rowwise=row_t, columnwise=col_t,
                            columnwise_source="original")
    tiles = kernels.mxfp4_qat_fp8_block(w, direct)
    return FP8BlockTensor.wrap(w, FP8BlockSpec("128x128"), tiles, made_by, backend)


def token_multiple(host: Host) -> int:
    """Rows (tokens) a columnwise activation/gradient needs to be a multiple of."""
    return mxfp8.BLOCK if host is Host.MXFP8 else fp8_block.BLOCK


# The native GEMM of each host: the FP8 block host's runs torch._scaled_mm on fp32 block scales
# (sm_90+); the MXFP8 host has none wired here (block-scaled MX would need sm_100).
_NATIVE_FORMAT = {Host.MXFP8: None, Host.FP8_BLOCK128: ScaledMMFormat.FP8_BLOCK128}


def gemm_backend(host: Host, device: torch.device, native: bool = False) -> GemmBackend:
    """Chosen once per (host, device, native): the native FP8 block GEMM when asked for
    (MXFP4QATConfig.native_gemm, opt-in) on sm_90+, else exact emulation
    (qtensor.backends.qat_gemm_backend)."""
    return qat_gemm_backend(_NATIVE_FORMAT[host], device, native)
