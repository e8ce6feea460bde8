"""The GEMM ops grouped along K: the weight gradients of all experts of an MoE layer at once.

[Note: grouped along K]
    qtensor::nvfp4_grouped_mm_k(Tensor a, Tensor a_scale, Tensor a_amax, Tensor b,
                                Tensor b_scale, Tensor b_amax, Tensor offs, int a_bound,
                                int b_bound, ScalarType out_dtype) -> Tensor
    qtensor::mxfp8_grouped_mm_k(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor offs,
                                ScalarType out_dtype) -> Tensor

torch._grouped_mm's 2-D x 2-D form on quantized operands: a [M, K*] and b [N, K*] are rows along
K (as in [Note: GEMM ops]), both quantized, and expert e owns the K positions
[offs[e-1], offs[e]) (offs int32 [E], cumulative; offs[-1] <= K). The output is [E, M, N]:

    out[e] = epilogue_e(sum over k of expert e of A[m, k] * B[n, k])

with the dense epilogue of expert e's own operands: an NVFP4 amax is per expert, [E], or per
expert and row, [E, M] / [E, N] (row-scaled parts). A grouped linear's wgrad is this product of
its experts' gradient and input parts put side by side along the tokens (each a block-aligned
range, so no block straddles two experts), and an expert without tokens gets exact zeros.

The ranges start and end on whole blocks (16 NVFP4 elements, 32 MXFP8): the CPU op and the
reference check it; the CUDA kernel relies on it unchecked, as a check would wait for the GPU
(qtensor.gemm.grouped derives offs from host counts that guarantee it).

Implementations: on the CPU each expert's K range through the dense CPU product (`cpu_mm`), so
out[e] is bitwise that expert's own dense product; on CUDA both operands decoded to exact bf16
once and one Triton launch for every expert (qtensor/kernels/grouped_qgemm.py), equal to the
reference up to the order of the fp32 sums; elsewhere the reference. Neither operand has a
gradient (both are quantized bytes), so the ops register no autograd formula.
"""

from __future__ import annotations

import torch

from qtensor.ops import gemm_ops
from qtensor.ops.gemm_operands import MXFP8, NVFP4, Side, check_grouped_k
from qtensor.ops.gemm_triton import device_ok, triton_grouped_mm_k, triton_problem

FORMATS = (NVFP4, MXFP8)
SCHEMAS = {
    "nvfp4_grouped_mm_k": "(Tensor a, Tensor a_scale, Tensor a_amax, Tensor b, Tensor b_scale, "
                          "Tensor b_amax, Tensor offs, int a_bound, int b_bound, "
                          "ScalarType out_dtype) -> Tensor",
    "mxfp8_grouped_mm_k": "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor offs, "
                          "ScalarType out_dtype) -> Tensor",
}


def pack(fmt: str, a: Side, b: Side, offs, out_dtype) -> tuple:
    """The op's arguments in schema order."""
    if fmt == NVFP4:
        return (a.data, a.scale, a.amax, b.data, b.scale, b.amax, offs, a.bound, b.bound,
                out_dtype)
    return a.data, a.scale, b.data, b.scale, offs, out_dtype


def unpack(fmt: str, args):
    """(a, b, offs, out_dtype): `pack` read backwards."""
    if fmt == NVFP4:
        a_data, a_scale, a_amax, b_data, b_scale, b_amax, offs, a_bound, b_bound, out = args
        return (Side(a_data, a_scale, a_amax, a_bound), Side(b_data, b_scale, b_amax, b_bound),
                offs, out)
    a_data, a_scale, b_data, b_scale, offs, out = args
    return Side(a_data, a_scale), Side(b_data, b_scale), offs, out


def _columns(fmt: str, s: Side, e: int, k0: int, k1: int) -> Side:
    """Expert e's operand: its K range of s (contiguous) with its own amax."""
    per = 2 if fmt == NVFP4 else 1  # elements a data byte
    block = 16 if fmt == NVFP4 else 32
    data = s.data[:, k0 // per:k1 // per].contiguous()
    scale = s.scale[:, k0 // block:k1 // block].contiguous()
    return Side(data, scale, None if s.amax is None else s.amax[e], s.bound)


def _ranges(fmt: str, a: Side, offs) -> list[tuple[int, int]]:
    """The experts' K ranges as host ints (a device sync on a GPU: the reference and the CPU op
    only), checked: non-decreasing, within K, on block boundaries."""
    ends = offs.tolist()
    k = a.data.shape[1] * (2 if fmt == NVFP4 else 1)
    block = 16 if fmt == NVFP4 else 32
    starts = [0] + ends[:-1]
    if any(e1 < e0 for e0, e1 in zip(starts, ends)) or ends[-1] > k or \
            any(e % block for e in ends):
        raise ValueError(
            f"qtensor::{fmt}_grouped_mm_k: offs must be non-decreasing multiples of {block} "
            f"(whole {fmt} blocks) and at most K={k}; got {ends}.")
    return list(zip(starts, ends))


def _per_expert(fmt: str, a: Side, b: Side, offs, out_dtype, product) -> torch.Tensor:
    ranges = _ranges(fmt, a, offs)
    out = torch.zeros(len(ranges), a.data.shape[0], b.data.shape[0], dtype=out_dtype,
                      device=a.data.device)
    for e, (k0, k1) in enumerate(ranges):
        if k1 > k0:
            out[e] = product(fmt, _columns(fmt, a, e, k0, k1), _columns(fmt, b, e, k0, k1),
                             None, out_dtype)
    return out


def reference_grouped_mm_k(fmt: str, a: Side, b: Side, offs, out_dtype) -> torch.Tensor:
    """Per expert: exact fp32 units of its K range, matmul, the dense epilogue."""
    return _per_expert(fmt, a, b, offs, out_dtype, gemm_ops.reference_mm)


def cpu_grouped_mm_k(fmt: str, a: Side, b: Side, offs, out_dtype) -> torch.Tensor:
    """Per expert: the dense CPU op's product ([Note: CPU GEMM kernel]), so out[e] is bitwise
    expert e's own dense product."""
    return _per_expert(fmt, a, b, offs, out_dtype, gemm_ops.cpu_mm)


def _kernels(fmt: str):
    op = f"{fmt}_grouped_mm_k"

    def checked(args):
        a, b, offs, out_dtype = unpack(fmt, args)
        check_grouped_k(op, fmt, a, b, offs, out_dtype)
        return a, b, offs, out_dtype

    def cpu(*args):
        return cpu_grouped_mm_k(fmt, *checked(args))

    def cuda(*args):
        a, b, offs, out_dtype = checked(args)
        if triton_problem(a, b, None, out_dtype, grouped=True) is None and device_ok(a):
            return triton_grouped_mm_k(fmt, a, b, offs, out_dtype)
        return reference_grouped_mm_k(fmt, a, b, offs, out_dtype)

    def fake(*args):
        a, b, offs, out_dtype = checked(args)
        return a.data.new_empty((offs.shape[0], a.data.shape[0], b.data.shape[0]),
                                dtype=out_dtype)

    return cpu, cuda, fake


def _register() -> None:
    for fmt in FORMATS:
        name = f"{fmt}_grouped_mm_k"
        gemm_ops.define(name, SCHEMAS[name], *_kernels(fmt))


_register()


def grouped_mm_k(fmt: str, a: Side, b: Side, offs, out_dtype) -> torch.Tensor:
    """The op of `fmt` on these sides (its device kernel directly in plain eager)."""
    return gemm_ops.call(f"{fmt}_grouped_mm_k", *pack(fmt, a, b, offs, out_dtype))

