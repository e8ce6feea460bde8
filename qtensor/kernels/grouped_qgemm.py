"""Grouped GEMM for MoE experts (torch._grouped_mm semantics) on quantized operands (Triton).

out[rows of e] = epilogue_e(A[rows of e] @ B[e]^T), expert e owning rows [offs[e-1], offs[e]).
No host sync: the grid has an upper bound of M tiles, cdiv(T, BM) + E + 1 (each expert wastes at
most one partial tile, plus the zero tail), and each program finds its expert by walking offs
(E scalar loads, negligible next to a K loop of K / BK tile loads). Programs past the experts'
tiles zero the rows after offs[-1]; the rest exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qtensor.kernels import tiles
from qtensor.kernels.launch import Launcher
from qtensor.kernels.qgemm import Epilogue, Operand, cdiv

CONFIG = (128, 256, 64, 8, 3)  # BM, BN, BK, warps, stages: bf16 operands (decoded first)


def grouped_qgemm(a: Operand, b: Operand, offs, ep: Epilogue, *, out_dtype, t: int, n: int,
                  k: int, config=CONFIG) -> torch.Tensor:
    """[T, N]; a is [T, K*] (or [1, T, K*]), b is [E, N, K*] rows along K; amax_a 0-d or [T],
    amax_b 0-d or [E, N]."""
    bm, bn, bk, warps, stages = config
    experts = b.data.shape[0]
    out = torch.empty((t, n), dtype=out_dtype, device=b.data.device)
    (_, a_r, a_k), (_, as_r, as_k) = a.strides()
    (b_e, b_r, b_k), (bs_e, bs_r, bs_k) = b.strides()
    dummy = b.data
    lf, _, l_r, inv, rf, r_e, r_c, bias = ep.terms(dummy)
    grid = (cdiv(t, bm) + experts + 1, cdiv(n, bn))
    _GROUPED(
        grid,
        a.data, a.scale if a.scale is not None else dummy, a_r, a_k, as_r, as_k,
        b.data, b.scale if b.scale is not None else dummy, b_e, b_r, b_k, bs_e, bs_r, bs_k,
        offs, lf, l_r, inv, rf, r_e, r_c, bias,
        ep.bias.stride(0) if ep.bias is not None else 0, out, experts, t, n, k,
        FMT_A=a.fmt, FMT_B=b.fmt, **ep.flags(), BM=bm, BN=bn, BK=bk, num_warps=warps,
        num_stages=stages, enable_fp_fusion=False,
    )
    return out


@triton.jit
def _grouped_kernel(
    a_ptr, as_ptr, a_r, a_k, as_r, as_k,
    b_ptr, bs_ptr, b_e, b_r, b_k, bs_e, bs_r, bs_k, offs_ptr,
    left_ptr, l_r, inv, right_ptr, r_e, r_c, bias_ptr, bias_e, out_ptr, E, T, N, K,
    FMT_A: tl.constexpr, FMT_B: tl.constexpr, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # Loop-carried scalars need one type throughout the loop: int32 from the start.
    start = tl.full([], 0, tl.int32)
    seen = tl.full([], 0, tl.int32)
    expert = tl.full([], -1, tl.int32)
    row0 = tl.full([], 0, tl.int32)
    row_end = tl.full([], 0, tl.int32)
    for e in range(E):
        end = tl.load(offs_ptr + e)
        count = tl.cdiv(end - start, BM)
        hit = (pid_m >= seen) & (pid_m < seen + count)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, start + (pid_m - seen) * BM, row0)
        row_end = tl.where(hit, end, row_end)
        seen += count
        start = end
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    if expert >= 0:
        rows = row0 + tl.arange(0, BM)
        rmask = rows < row_end
        acc = tiles.mainloop(
            a_ptr, as_ptr, a_r, a_k, as_r, as_k, rows, rmask,
            b_ptr + expert * b_e, bs_ptr + expert * bs_e, b_r, b_k, bs_r, bs_k, cols, cmask,
            0, K, FMT_A, FMT_B, BM, BN, BK,
        )
        acc = tiles.epilogue(
            acc, rows, cols, rmask, cmask, left_ptr, l_r, inv, right_ptr + expert * r_e, r_c,
            bias_ptr + expert * bias_e, LEFT, HAS_RIGHT, HAS_BIAS,
        )
        mask = rmask[:, None] & cmask[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        rows = start + (pid_m - seen) * BM + tl.arange(0, BM)
        rmask = rows < T
        zero = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], zero,
                 mask=rmask[:, None] & cmask[None, :])


_GROUPED = Launcher(_grouped_kernel)
