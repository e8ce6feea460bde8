"""Dense and batched GEMMs of quantized operands on bf16 tensor cores (Triton).

`qgemm(a, b, ...)` computes out[b, m, n] = epilogue(sum_k A[b, m, k] * B[b, n, k]) where each
operand is an `Operand`: a bf16 tensor or a quantized tensor's bytes as "rows along K" (the left
operand's rows are M, the right operand's rows are N; that is NVFP4 columnwise storage and the
transpose view of MXFP8 columnwise data). Decode and epilogue: [Note: exact decode in registers]
in tiles.py; the epilogue order is the emulated reference's (qtensor/ops/gemm.py).

Small M (<= 64, decode) runs split-K: the weight is what must stream, and N / 64 tiles alone
(128 for N = 8192) leave most of the 132 SMs of an H200 idle; the K range is split so that about
four programs per SM are in flight, each writes fp32 partials, and a second kernel sums the
splits in a fixed order and applies the epilogue (deterministic; no atomics, no memset).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from qtensor.kernels import tiles

FMT_HP, FMT_NVFP4, FMT_MXFP8 = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Operand:
    """One GEMM operand as rows along K, with a leading batch dim (size 1 broadcasts)."""

    fmt: int  # FMT_HP, FMT_NVFP4 or FMT_MXFP8
    data: torch.Tensor  # [B, R, K] bf16 | [B, R, K/2] uint8 | [B, R, K] float8_e4m3fn
    scale: torch.Tensor | None  # [B, R, K/16] float8_e4m3fn | [B, R, K/32] uint8 | None

    def strides(self):
        """(batch, row, k) strides of data and of scale; batch stride 0 when broadcast."""
        d, s = self.data, self.scale if self.scale is not None else self.data
        bd = d.stride(0) if d.shape[0] > 1 else 0
        bs = s.stride(0) if s.shape[0] > 1 else 0
        return (bd, d.stride(1), d.stride(2)), (bs, s.stride(1), s.stride(2))


@dataclasses.dataclass(frozen=True)
class Config:
    bm: int
    bn: int
    bk: int  # elements of K per step (NVFP4 loads bk/2 bytes)
    split: int  # K splits; 1 fuses the epilogue into the GEMM kernel
    warps: int
    stages: int
    group_m: int = 8  # M tiles walked together for L2 reuse of the B tiles


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(m: int, n: int, k: int, batch: int, sms: int) -> Config:
    """Decode shapes (m <= 64) split K to fill the SMs; larger m uses 128x128 tiles."""
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        bn, bk = 64, 256
        tiles_mn = triton.cdiv(n, bn) * batch
        steps = triton.cdiv(k, bk)
        split = max(1, min(steps // 4, triton.cdiv(4 * sms, tiles_mn)))
        return Config(bm, bn, bk, split, warps=4, stages=4)
    return Config(128, 128, 128, 1, warps=8, stages=3)


def _factor(t: torch.Tensor | None, shape) -> tuple[torch.Tensor, int, int]:
    """A left [.., M, 1] / right [.., 1, N] / scalar factor expanded to [B, L, 1 or L]."""
    if t is None:
        return None, 0, 0
    e = t.float().expand(shape)
    return e, e.stride(0), e.stride(1) if shape[1] > 1 else e.stride(2)


def qgemm(a: Operand, b: Operand, *, left=None, right=None, bias=None, out_dtype,
          m: int, n: int, k: int, config: Config | None = None) -> torch.Tensor:
    """[B, M, N] = epilogue(A @ B^T); left [B?, M, 1] / right [B?, 1, N] / bias [N] optional."""
    batch = max(a.data.shape[0], b.data.shape[0])
    dev = b.data.device
    cfg = config or pick_config(m, n, k, batch, _sm_count(dev.index or 0))
    out = torch.empty((batch, m, n), dtype=out_dtype, device=dev)
    (a_b, a_r, a_k), (as_b, as_r, as_k) = a.strides()
    (b_b, b_r, b_k), (bs_b, bs_r, bs_k) = b.strides()
    lf, l_b, l_r = _factor(left, (batch, m, 1))
    rf, r_b, r_c = _factor(right, (batch, 1, n))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.bk) * cfg.bk
    split = triton.cdiv(k, k_per_split)
    ws = out if split == 1 else torch.empty((split, batch, m, n), dtype=torch.float32, device=dev)
    dummy = b.data
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn), split, batch)
    _qgemm_kernel[grid](
        a.data, a.scale if a.scale is not None else dummy, a_b, a_r, a_k, as_b, as_r, as_k,
        b.data, b.scale, b_b, b_r, b_k, bs_b, bs_r, bs_k,
        lf if lf is not None else dummy, l_b, l_r, rf if rf is not None else dummy, r_b, r_c,
        bias if bias is not None else dummy, out, ws, batch, m, n, k, k_per_split,
        FMT_A=a.fmt, FMT_B=b.fmt, HAS_LEFT=lf is not None, HAS_RIGHT=rf is not None,
        HAS_BIAS=bias is not None, FUSED=split == 1, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
        GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages,
        enable_fp_fusion=False,
    )
    if split > 1:
        eb_m, eb_n = 32, 128
        grid = (triton.cdiv(m, eb_m) * triton.cdiv(n, eb_n), batch)
        _splitk_epilogue_kernel[grid](
            ws, out, lf if lf is not None else dummy, l_b, l_r,
            rf if rf is not None else dummy, r_b, r_c, bias if bias is not None else dummy,
            batch, m, n, split, HAS_LEFT=lf is not None, HAS_RIGHT=rf is not None,
            HAS_BIAS=bias is not None, BM=eb_m, BN=eb_n, num_warps=4, enable_fp_fusion=False,
        )
    return out


@triton.jit
def _qgemm_kernel(
    a_ptr, as_ptr, a_b, a_r, a_k, as_b, as_r, as_k,
    b_ptr, bs_ptr, b_b, b_r, b_k, bs_b, bs_r, bs_k,
    left_ptr, l_b, l_r, right_ptr, r_b, r_c, bias_ptr, out_ptr, ws_ptr,
    B, M, N, K, k_per_split,
    FMT_A: tl.constexpr, FMT_B: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid, pid_k, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tiles.mainloop(
        a_ptr + bat * a_b, as_ptr + bat * as_b, a_r, a_k, as_r, as_k, rows, rmask,
        b_ptr + bat * b_b, bs_ptr + bat * bs_b, b_r, b_k, bs_r, bs_k, cols, cmask,
        k_lo, k_hi, FMT_A, FMT_B, BM, BN, BK,
    )
    mask = rmask[:, None] & cmask[None, :]
    offs = (bat * M + rows)[:, None] * N + cols[None, :]
    if FUSED:
        acc = tiles.epilogue(
            acc, rows, cols, rmask, cmask, left_ptr + bat * l_b, l_r, right_ptr + bat * r_b,
            r_c, bias_ptr, HAS_LEFT, HAS_RIGHT, HAS_BIAS,
        )
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * B * M * N + offs, acc, mask=mask)


@triton.jit
def _splitk_epilogue_kernel(
    ws_ptr, out_ptr, left_ptr, l_b, l_r, right_ptr, r_b, r_c, bias_ptr, B, M, N, SPLIT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """Sum the K splits in order 0..SPLIT-1, then the epilogue and the cast."""
    pid, bat = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    rows = (pid // num_n) * BM + tl.arange(0, BM)
    cols = (pid % num_n) * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = (bat * M + rows)[:, None] * N + cols[None, :]
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(ws_ptr + s * B * M * N + offs, mask=mask, other=0.0)
    acc = tiles.epilogue(
        acc, rows, cols, rmask, cmask, left_ptr + bat * l_b, l_r, right_ptr + bat * r_b, r_c,
        bias_ptr, HAS_LEFT, HAS_RIGHT, HAS_BIAS,
    )
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
