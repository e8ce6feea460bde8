"""Grouped GEMM for MoE experts (torch._grouped_mm semantics) on quantized operands (Triton).

out[rows of e] = epilogue_e(A[rows of e] @ B[e]^T), expert e owning rows [offs[e-1], offs[e]).
No host sync: the M tiles have an upper bound, cdiv(T, BM) + E + 1 (each expert wastes at most
one partial tile, plus the zero tail), and each tile finds its expert by walking offs (E scalar
loads, negligible next to a K loop of K / BK tile loads). Tiles past the experts' zero the rows
after offs[-1]; the rest do nothing.

[Note: persistent grouped GEMM]
Where the GPU has TMA, the decoded bf16 tokens are 16-byte aligned and the product has at least
TMA_MIN_MNK multiply-adds, one program per SM walks these tiles (`_grouped_tma_kernel`). The token
tile arrives by TMA at any row offset (rows past T arrive as zeros). The expert's weight tile
either streams as its codes (NVFP4 or MXFP8, with their scales), decoded in registers as the tiled
kernel decodes them and put in element order, or arrives by TMA from weights decoded to bf16 first
(B viewed as [E * N, K]); the first spares the layer a bf16 copy of all E x N x K weights, written
and read back on every call (`STREAM_WEIGHT_CODES`, off: slower, as measured at the flag). The rows
of a tile that belong to the next expert, and the columns past N, are computed and never stored:
the stores are masked, as the tiled kernel's are, and go out by quarters of the tile to keep the
epilogue's registers down. The epilogue is the same terms in the same order. Consecutive tiles
share an M tile and walk N, so the programs in flight read a few experts' weights at a time from
L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qtensor.kernels import tiles
from qtensor.kernels.launch import Launcher
from qtensor.kernels.qgemm import (
    FMT_HP,
    TMA_CONFIG,
    Epilogue,
    Operand,
    TensorDescriptor,
    TmaConfig,
    _capability,
    _sm_count,
    cdiv,
    tma_rows,
)

CONFIG = (128, 256, 64, 8, 3)  # BM, BN, BK, warps, stages: bf16 operands (decoded first)
# The persistent kernel on the weights' codes: 128x256 tiles leave no registers for the decode
# (ptxas spills), 128x128 with 8 warps fit.
CODES_CONFIG = TmaConfig(128, 128, 64, 8, 4, False)
# grouped_qgemm_k (decoded operands; a wgrad's experts: M, N of 768-2048, K of a few hundred)
K_CONFIG = (128, 256, 64, 8, 3)


def tma_problem(a: Operand, b: Operand, out_dtype) -> str | None:
    """Why the persistent grouped kernel cannot run this product, or None. A is bf16 (decoded);
    B is bf16, or NVFP4 / MXFP8 codes that the kernel decodes as they stream."""
    if TensorDescriptor is None:
        return "this Triton has no host TMA descriptors"
    if a.fmt != FMT_HP or a.data.dtype != torch.bfloat16:
        return "the tokens must be bf16 (decoded)"
    if b.fmt == FMT_HP and b.data.dtype != torch.bfloat16:
        return "high-precision expert weights must be bf16 (decoded)"
    if a.data.dim() != 2 and a.data.shape[0] != 1:
        return "the tokens must be one [T, K] matrix"
    if _capability(b.data.device.index or 0)[0] < 9:
        return "TMA needs sm_90 or newer"
    if b.fmt == FMT_HP and not b.data.is_contiguous():
        return "the expert weights must be one contiguous [E, N, K] tensor"
    if b.fmt != FMT_HP and (b.data.stride(-1) != 1 or b.scale.stride(-1) != 1):
        return "the expert weights' codes and scales must have contiguous rows"
    if not tma_rows(a.data) or (b.fmt == FMT_HP and not tma_rows(b.data)):
        return "an operand's rows are not 16-byte aligned and contiguous"
    return None


# Products of fewer multiply-adds keep the tiled kernel: the persistent kernel's launch builds its
# TMA descriptors on the host, and Triton's launcher encodes their tensor maps on every launch,
# about 30 us more host time a call than the tiled kernel's, which an MoE layer of 8 experts at
# 8192 tokens (2**34.6 multiply-adds) does not win back: on an H100, 179 us a call back to back
# against the tiled kernel's 152 us. 128 experts at 65,536 tokens (2**37.6) run 1348 us against
# 1582 us.
TMA_MIN_MNK = 1 << 36

# Whether the layer hands the persistent kernel the expert weights' codes, decoded in the
# kernel as they stream, rather than decoding every weight to bf16 first (an E x N x K bf16
# copy written and read back on every call). Off: the in-register decode costs the kernel more
# than the copy costs (H100, 128 experts, 65,536 x 1536 x 2048: the kernel on NVFP4 codes
# 2468-2585 us and on MXFP8 codes 1427-1447 us, against 831 us on bf16 operands after a weight
# decode of 364 us for NVFP4 and about 420 us for MXFP8).
STREAM_WEIGHT_CODES = False


def takes_codes(a: Operand, b: Operand, out_dtype, t: int, n: int, k: int) -> bool:
    """Whether grouped_qgemm runs on b's codes as they are (else decode b with decode_bf16)."""
    return STREAM_WEIGHT_CODES and b.fmt != FMT_HP and t * n * k >= TMA_MIN_MNK and \
        tma_problem(a, b, out_dtype) is None


def grouped_qgemm(a: Operand, b: Operand, offs, ep: Epilogue, *, out_dtype, t: int, n: int,
                  k: int, config=None) -> torch.Tensor:
    """[T, N]; a is [T, K*] (or [1, T, K*]), b is [E, N, K*] rows along K; amax_a 0-d or [T],
    amax_b 0-d or [E, N]. `config`: a tiled kernel's (BM, BN, BK, warps, stages), or a TmaConfig
    for the persistent kernel (which must be able to: tma_problem); None picks."""
    if isinstance(config, TmaConfig) or (
            config is None and t * n * k >= TMA_MIN_MNK and tma_problem(a, b, out_dtype) is None):
        cfg = config or (TMA_CONFIG if b.fmt == FMT_HP else CODES_CONFIG)
        return _grouped_tma(a, b, offs, ep, out_dtype, t, n, k, cfg)
    bm, bn, bk, warps, stages = config or CONFIG
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


def _grouped_tma(a: Operand, b: Operand, offs, ep: Epilogue, out_dtype, t: int, n: int, k: int,
                 cfg: TmaConfig) -> torch.Tensor:
    """[Note: persistent grouped GEMM]."""
    experts = b.data.shape[0]
    out = torch.empty((t, n), dtype=out_dtype, device=b.data.device)
    a2 = a.data.reshape(t, a.data.shape[-1])
    a_desc = TensorDescriptor.from_tensor(a2, [cfg.bm, cfg.bk])
    if b.fmt == FMT_HP:
        b_desc = TensorDescriptor.from_tensor(b.data.reshape(experts * n, b.data.shape[-1]),
                                              [cfg.bn, cfg.bk])
        b_args = (b.data, b.data, 0, 0, 0, 0)
    else:  # codes decoded in the kernel: NVFP4 [E, N, K/2] + [E, N, K/16], MXFP8 [E, N, K] +
        # [E, N, K/32], each row contiguous
        b_desc = None
        b_args = (b.data, b.scale, b.data.stride(0), b.data.stride(1), b.scale.stride(0),
                  b.scale.stride(1))
    lf, _, l_r, inv, rf, r_e, r_c, bias = ep.terms(b.data)
    tiles_mn = (cdiv(t, cfg.bm) + experts + 1) * cdiv(n, cfg.bn)
    programs = min(_sm_count(b.data.device.index or 0), tiles_mn)
    _GROUPED_TMA(
        (programs,), a_desc, b_desc, *b_args, offs, lf, l_r, inv, rf, r_e, r_c, bias,
        ep.bias.stride(0) if ep.bias is not None else 0, out, experts, t, n, k,
        FMT_B=b.fmt, **ep.flags(), BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, PROGRAMS=programs,
        num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=False,
    )
    return out


def _expert_strides(amax: torch.Tensor | None) -> tuple[int, int]:
    """(expert, row) strides of a per-expert amax: [E] (one value an expert) or [E, R]."""
    if amax is None:
        return 0, 0
    return (amax.stride(0), 0) if amax.dim() == 1 else (amax.stride(0), amax.stride(1))


def grouped_qgemm_k(a: Operand, b: Operand, offs, ep: Epilogue, *, out_dtype, m: int,
                    n: int, config=None) -> torch.Tensor:
    """[E, M, N]: out[e] = epilogue_e(A[:, K of e] @ B[:, K of e]^T), expert e owning the K
    positions [offs[e-1], offs[e]) ([Note: grouped along K]). a [M, K] and b [N, K] are bf16
    (decoded first), rows along K; amax_a [E] or [E, M], amax_b [E] or [E, N]. One program per
    output tile and expert; an expert of no K positions stores zeros (its loop is empty)."""
    bm, bn, bk, warps, stages = config or K_CONFIG
    if a.fmt != FMT_HP or b.fmt != FMT_HP:
        raise ValueError("grouped_qgemm_k takes operands decoded to bf16 (decode_bf16).")
    experts = offs.shape[0]
    out = torch.empty((experts, m, n), dtype=out_dtype, device=b.data.device)
    a2, b2 = a.data.reshape(m, a.data.shape[-1]), b.data.reshape(n, b.data.shape[-1])
    l_e, l_r = _expert_strides(ep.amax_a)
    r_e, r_c = _expert_strides(ep.amax_b)
    lf = ep.amax_a if ep.amax_a is not None else a2
    rf = ep.amax_b if ep.amax_b is not None else a2
    grid = (cdiv(m, bm) * cdiv(n, bn), experts)
    _GROUPED_K(
        grid, a2, a2.stride(0), a2.stride(1), b2, b2.stride(0), b2.stride(1), offs,
        lf, l_e, l_r, ep.inv or 1.0, rf, r_e, r_c, out, m, n, LEFT=ep.left_mode(),
        HAS_RIGHT=ep.amax_b is not None, BM=bm, BN=bn, BK=bk, num_warps=warps,
        num_stages=stages, enable_fp_fusion=False,
    )
    return out


@triton.jit
def _grouped_k_kernel(
    a_ptr, a_r, a_k, b_ptr, b_r, b_k, offs_ptr, left_ptr, l_e, l_r, inv, right_ptr, r_e, r_c,
    out_ptr, M, N, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):
    pid, expert = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = pid // num_n, pid % num_n
    # The experts' ranges start and end on whole blocks (16 elements): said to the compiler,
    # so that the masked loads stay 16-byte vectors.
    k_lo = tl.multiple_of(tl.where(expert > 0, tl.load(offs_ptr + tl.maximum(expert - 1, 0)), 0),
                          16)
    k_hi = tl.multiple_of(tl.load(offs_ptr + expert), 16)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(k_lo, k_hi, BK):
        k = tl.multiple_of(kk, 16) + tl.arange(0, BK)
        kmask = (k < k_hi)[None, :]
        a = tl.load(a_ptr + rows[:, None] * a_r + k[None, :] * a_k, mask=rmask[:, None] & kmask,
                    other=0.0)
        b = tl.load(b_ptr + cols[:, None] * b_r + k[None, :] * b_k, mask=cmask[:, None] & kmask,
                    other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    acc = tiles.epilogue(
        acc, rows, cols, rmask, cmask, left_ptr + expert * l_e, l_r, inv,
        right_ptr + expert * r_e, r_c, left_ptr, LEFT, HAS_RIGHT, False,
    )
    out = out_ptr + expert.to(tl.int64) * M * N
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _expert_of(offs_ptr, pid_m, E, BM: tl.constexpr):
    """(expert, first row, end row) of M tile pid_m; expert -1 past the experts' tiles, its
    first row then the first of the zero tail's rows it covers."""
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
    row0 = tl.where(expert >= 0, row0, start + (pid_m - seen) * BM)
    return expert, row0, row_end


@triton.jit
def _grouped_kernel(
    a_ptr, as_ptr, a_r, a_k, as_r, as_k,
    b_ptr, bs_ptr, b_e, b_r, b_k, bs_e, bs_r, bs_k, offs_ptr,
    left_ptr, l_r, inv, right_ptr, r_e, r_c, bias_ptr, bias_e, out_ptr, E, T, N, K,
    FMT_A: tl.constexpr, FMT_B: tl.constexpr, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert, row0, row_end = _expert_of(offs_ptr, pid_m, E, BM)
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
        rows = row0 + tl.arange(0, BM)
        rmask = rows < T
        zero = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], zero,
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_tma_kernel(
    a_desc, b_desc, b_ptr, bs_ptr, b_e, b_r, bs_e, bs_r, offs_ptr, left_ptr, l_r, inv,
    right_ptr, r_e, r_c, bias_ptr, bias_e, out_ptr, E, T, N, K,
    FMT_B: tl.constexpr, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PROGRAMS: tl.constexpr,
):
    """[Note: persistent grouped GEMM]: program p takes tiles p, p + PROGRAMS, ..."""
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in range(tl.program_id(0), (tl.cdiv(T, BM) + E + 1) * num_n, PROGRAMS):
        pid_m, pid_n = tile // num_n, tile % num_n
        expert, row0, row_end = _expert_of(offs_ptr, pid_m, E, BM)
        rows = row0 + tl.arange(0, BM)
        if expert >= 0:
            off_n = pid_n * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if FMT_B == tiles.NVFP4:
                # The expert's codes decoded in registers as they stream (no bf16 copy of the
                # weights), put back in element order so that A multiplies from shared memory
                # as TMA left it.
                cols_b = off_n + tl.arange(0, BN)
                bmask = cols_b < N
                for kt in range(k_tiles):
                    a = a_desc.load([row0, kt * BK])
                    b_ev, b_od = tiles.load_nvfp4(
                        b_ptr + expert * b_e, bs_ptr + expert * bs_e, cols_b, bmask,
                        kt * (BK // 2), K // 2, b_r, 1, bs_r, 1, BN, BK // 2)
                    acc = tl.dot(a, tl.trans(tl.interleave(b_ev, b_od)), acc)
            elif FMT_B == tiles.MXFP8:
                cols_b = off_n + tl.arange(0, BN)
                bmask = cols_b < N
                for kt in range(k_tiles):
                    a = a_desc.load([row0, kt * BK])
                    b = tiles.load_mxfp8(b_ptr + expert * b_e, bs_ptr + expert * bs_e, cols_b,
                                         bmask, kt * BK, K, b_r, 1, bs_r, 1, BN, BK)
                    acc = tl.dot(a, tl.trans(b), acc)
            else:
                for kt in range(k_tiles):
                    a = a_desc.load([row0, kt * BK])
                    b = b_desc.load([expert * N + off_n, kt * BK])
                    acc = tl.dot(a, b.T, acc)
            rmask = rows < row_end
            # Quarters of the tile, each through the epilogue and stored: fewer live registers.
            q = tl.permute(tl.reshape(acc, (BM, 2, 2, BN // 4)), (0, 3, 2, 1))
            h0, h1 = tl.split(q)
            acc00, acc01 = tl.split(h0)
            acc10, acc11 = tl.split(h1)
            cols = off_n + tl.arange(0, BN // 4)
            _epilogue_store(acc00, rows, cols, rmask, N,
                            left_ptr, l_r, inv, right_ptr + expert * r_e,
                            r_c, bias_ptr + expert * bias_e, out_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
            _epilogue_store(acc01, rows, cols + BN // 4, rmask, N,
                            left_ptr, l_r, inv, right_ptr + expert * r_e,
                            r_c, bias_ptr + expert * bias_e, out_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
            _epilogue_store(acc10, rows, cols + BN // 2, rmask, N,
                            left_ptr, l_r, inv, right_ptr + expert * r_e,
                            r_c, bias_ptr + expert * bias_e, out_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
            _epilogue_store(acc11, rows, cols + 3 * BN // 4, rmask, N,
                            left_ptr, l_r, inv, right_ptr + expert * r_e,
                            r_c, bias_ptr + expert * bias_e, out_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
        else:
            zcols = pid_n * BN + tl.arange(0, BN)
            zero = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * N + zcols[None, :], zero,
                     mask=(rows < T)[:, None] & (zcols < N)[None, :])


@triton.jit
def _epilogue_store(acc, rows, cols, rmask, N, left_ptr, l_r, inv, right_ptr, r_c, bias_ptr,
                    out_ptr, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    cmask = cols < N
    acc = tiles.epilogue(acc, rows, cols, rmask, cmask, left_ptr, l_r, inv, right_ptr, r_c,
                         bias_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


_GROUPED = Launcher(_grouped_kernel)
_GROUPED_TMA = Launcher(_grouped_tma_kernel)
_GROUPED_K = Launcher(_grouped_k_kernel)
