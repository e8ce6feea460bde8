"""The backend enums, their value maps, and the compile-time-constant marker.

Backends are stored on tensors as plain strings (checkpoints stay loadable with
weights_only=True); these enums name them in code.
"""

from __future__ import annotations

import enum


class QuantBackend(str, enum.Enum):
    REFERENCE = "reference"  # pure torch, qtensor/formats: the spec in code
    CPU = "cpu"  # C++ kernels of csrc/
    CUDA = "cuda"  # CUDA kernels of csrc/


class GemmBackend(str, enum.Enum):
    EMULATED = "emulated"  # decode to exact fp32 units + torch matmul: the reference
    TRITON = "triton"  # decode in registers, bf16 tensor cores, fp32 accumulation
    SCALED_MM = "scaled_mm"  # native torch._scaled_mm; what it needs depends on ScaledMMFormat


class ScaledMMFormat(str, enum.Enum):
    """The operand format a native torch._scaled_mm multiplies, which decides the GPU it needs."""

    # MXFP8 / NVFP4 bytes with UE8M0 / E4M3 scales per 32 / 16 elements (docs/formats.md): the
    # block-scaled FP4/FP8 tensor cores of sm_100+. Never on Hopper, which runs them on Triton.
    MX_BLOCK = "mx_block"
    # FP8 E4M3 with fp32 scales per 1x128 row block or 128x128 tile (the QAT FP8 block host):
    # sm_90+ FP8 tensor cores.
    FP8_BLOCK128 = "fp8_block128"


def compile_time_constant(fn):
    """Mark fn as torch.compile's `torch.compiler.assume_constant_result` does (Dynamo calls it
    at trace time and keeps its result as a constant), without importing Dynamo when qtensor
    is imported: the public function sets exactly this attribute, but importing it costs about
    a second. tests/test_compile_inference.py checks that the two agree."""
    fn._dynamo_marked_constant = True
    return fn


# The members by value. Code that torch.compile traces looks a backend up here rather than
# calling the Enum (Dynamo on torch 2.11 cannot trace Enum construction from a value).
QUANT_BACKENDS = {b.value: b for b in QuantBackend}
GEMM_BACKENDS = {b.value: b for b in GemmBackend}
