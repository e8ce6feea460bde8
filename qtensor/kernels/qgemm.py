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


# Products with more rows than this decode each quantized operand to bf16 once (decode_bf16)
# and run the plain bf16 GEMM; up to it, the weight is decoded in registers while it streams.
DECODE_FIRST_M = 64


def pick_config(m: int, n: int, k: int, batch: int, sms: int) -> Config:
    """Decode shapes (m <= 64) split K to fill the SMs; larger m uses 128x256 tiles."""
    if m <= DECODE_FIRST_M:
        bm = max(16, triton.next_power_of_2(m))
        bn, bk = 64, 256
        tiles_mn = triton.cdiv(n, bn) * batch
        steps = triton.cdiv(k, bk)
        split = max(1, min(steps // 4, triton.cdiv(4 * sms, tiles_mn)))
        return Config(bm, bn, bk, split, warps=4, stages=4)
    return Config(128, 256, 64, 1, warps=8, stages=4)  # 858 us vs 882 with 3 (sweep, H200)


def _vector(t: torch.Tensor | None, shape) -> tuple[torch.Tensor | None, int, int]:
    """An amax, scalar or [.., M, 1] / [.., 1, N], expanded to `shape` (no copy): (t, sb, s)."""
    if t is None:
        return None, 0, 0
    e = t.expand(shape)
    return e, e.stride(0), e.stride(1) if shape[1] > 1 else e.stride(2)


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """The epilogue's terms: acc * (amax_a * inv) (or * inv), then * amax_b, then + bias."""

    amax_a: torch.Tensor | None  # fp32 scalar or [.., M, 1]; None unless A is NVFP4
    inv: float | None  # fp32 r(1 / (36 B_a B_b)) or r(1 / (6 B)); None without NVFP4
    amax_b: torch.Tensor | None  # fp32 scalar or [.., 1, N]; None unless B is NVFP4
    bias: torch.Tensor | None  # [N] (or [E, N] grouped), any float dtype

    def left_mode(self) -> int:
        return 0 if self.inv is None else (2 if self.amax_a is not None else 1)


def qgemm(a: Operand, b: Operand, ep: Epilogue, *, out_dtype, m: int, n: int, k: int,
          config: Config | None = None) -> torch.Tensor:
    """[B, M, N] = epilogue(A @ B^T) for operands given as rows along K."""
    batch = max(a.data.shape[0], b.data.shape[0])
    dev = b.data.device
    cfg = config or pick_config(m, n, k, batch, _sm_count(dev.index or 0))
    out = torch.empty((batch, m, n), dtype=out_dtype, device=dev)
    (a_b, a_r, a_k), (as_b, as_r, as_k) = a.strides()
    (b_b, b_r, b_k), (bs_b, bs_r, bs_k) = b.strides()
    lf, l_b, l_r = _vector(ep.amax_a, (batch, m, 1))
    rf, r_b, r_c = _vector(ep.amax_b, (batch, 1, n))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.bk) * cfg.bk
    split = triton.cdiv(k, k_per_split)
    ws = out if split == 1 else torch.empty((split, batch, m, n), dtype=torch.float32, device=dev)
    dummy = b.data
    flags = dict(LEFT=ep.left_mode(), HAS_RIGHT=rf is not None, HAS_BIAS=ep.bias is not None)
    terms = (lf if lf is not None else dummy, l_b, l_r, ep.inv or 1.0,
             rf if rf is not None else dummy, r_b, r_c,
             ep.bias if ep.bias is not None else dummy)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn), split, batch)
    _qgemm_kernel[grid](
        a.data, a.scale if a.scale is not None else dummy, a_b, a_r, a_k, as_b, as_r, as_k,
        b.data, b.scale if b.scale is not None else dummy, b_b, b_r, b_k, bs_b, bs_r, bs_k,
        *terms, out, ws, batch, m, n, k, k_per_split,
        FMT_A=a.fmt, FMT_B=b.fmt, FUSED=split == 1, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
        GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages,
        enable_fp_fusion=False, **flags,
    )
    if split > 1:
        eb_m, eb_n = 32, 128
        grid = (triton.cdiv(m, eb_m) * triton.cdiv(n, eb_n), batch)
        _splitk_epilogue_kernel[grid](
            ws, out, *terms, batch, m, n, split, BM=eb_m, BN=eb_n, num_warps=4,
            enable_fp_fusion=False, **flags,
        )
    return out


def decode_bf16(x: Operand, rows: int, k: int) -> Operand:
    """The exact bf16 unit values [B, R, K] of a quantized operand (one streaming pass).

    Large products decode each operand once and then run the plain bf16 GEMM: decoding inside
    the K loop repeats the work for every tile that reads the operand (N / BN times for A).
    """
    if x.fmt == FMT_HP:
        return x
    batch = x.data.shape[0]
    out = torch.empty((batch, rows, k), dtype=torch.bfloat16, device=x.data.device)
    (d_b, d_r, d_k), (s_b, s_r, s_k) = x.strides()
    br, bk = 32, 256
    grid = (triton.cdiv(rows, br), triton.cdiv(k, bk), batch)
    _decode_kernel[grid](x.data, x.scale, d_b, d_r, d_k, s_b, s_r, s_k, out, rows, k,
                         FMT=x.fmt, BR=br, BK=bk, num_warps=4)
    return Operand(FMT_HP, out, None)


@triton.jit
def _decode_kernel(q_ptr, s_ptr, q_b, q_r, q_k, s_b, s_r, s_k, out_ptr, R, K,
                   FMT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    pid_r, pid_k, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * BR + tl.arange(0, BR)
    rmask = rows < R
    q_ptr += bat * q_b
    s_ptr += bat * s_b
    k = pid_k * BK + tl.arange(0, BK)
    if FMT == tiles.NVFP4:
        ev, od = tiles.load_nvfp4(q_ptr, s_ptr, rows, rmask, pid_k * (BK // 2), K // 2, q_r, q_k,
                                  s_r, s_k, BR, BK // 2)
        vals = tl.interleave(ev, od)
    else:
        vals = tiles.load_mxfp8(q_ptr, s_ptr, rows, rmask, pid_k * BK, K, q_r, q_k, s_r, s_k,
                                BR, BK)
    mask = rmask[:, None] & (k < K)[None, :]
    tl.store(out_ptr + (bat * R + rows)[:, None] * K + k[None, :], vals, mask=mask)


@triton.jit
def _qgemm_kernel(
    a_ptr, as_ptr, a_b, a_r, a_k, as_b, as_r, as_k,
    b_ptr, bs_ptr, b_b, b_r, b_k, bs_b, bs_r, bs_k,
    left_ptr, l_b, l_r, inv, right_ptr, r_b, r_c, bias_ptr, out_ptr, ws_ptr,
    B, M, N, K, k_per_split,
    FMT_A: tl.constexpr, FMT_B: tl.constexpr, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
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
            acc, rows, cols, rmask, cmask, left_ptr + bat * l_b, l_r, inv,
            right_ptr + bat * r_b, r_c, bias_ptr, LEFT, HAS_RIGHT, HAS_BIAS,
        )
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * B * M * N + offs, acc, mask=mask)


@triton.jit
def _splitk_epilogue_kernel(
    ws_ptr, out_ptr, left_ptr, l_b, l_r, inv, right_ptr, r_b, r_c, bias_ptr, B, M, N, SPLIT,
    LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
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
        acc, rows, cols, rmask, cmask, left_ptr + bat * l_b, l_r, inv, right_ptr + bat * r_b,
        r_c, bias_ptr, LEFT, HAS_RIGHT, HAS_BIAS,
    )
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
