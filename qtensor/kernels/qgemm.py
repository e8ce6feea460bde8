"""Dense and batched GEMMs of quantized operands on bf16 tensor cores (Triton).

`qgemm(a, b, ...)` computes out[b, m, n] = epilogue(sum_k A[b, m, k] * B[b, n, k]) where each
operand is an `Operand`: a bf16 tensor or a quantized tensor's bytes as "rows along K" (the left
operand's rows are M, the right operand's rows are N; that is NVFP4 columnwise storage and the
transpose view of MXFP8 columnwise data). Decode and epilogue: [Note: exact decode in registers]
in tiles.py; the epilogue order is the emulated reference's (qtensor/gemm/dense.py).

Small M (<= 64, decode) runs split-K: the weight is what must stream, and N / 64 tiles alone
(128 for N = 8192) leave most of the 132 SMs of an H200 idle; the K range is split so that about
four programs per SM are in flight, each writes fp32 partials, and a second kernel sums the
splits in a fixed order and applies the epilogue (deterministic; no atomics, no memset).

Large products of bf16 operands (quantized ones decoded first) run a persistent kernel where the
GPU has TMA (sm_90+): [Note: persistent TMA GEMM].
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from qtensor.kernels import tiles
from qtensor.kernels.launch import Launcher

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: every product takes the tiled kernel
    TensorDescriptor = None

FMT_HP, FMT_NVFP4, FMT_MXFP8 = 0, 1, 2


def cdiv(a: int, b: int) -> int:
    # Plain integer arithmetic: triton.cdiv is a constexpr function whose argument unwrapping
    # costs microseconds per call on the host.
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, k) strides of a 2-D or 3-D tensor; batch stride 0 when it broadcasts."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1), t.stride(2)


class Operand(NamedTuple):
    """One GEMM operand as rows along K: 2-D [R, K*], or 3-D [B, R, K*] (B = 1 broadcasts)."""

    fmt: int  # FMT_HP, FMT_NVFP4 or FMT_MXFP8
    data: torch.Tensor  # [.., R, K] bf16 | [.., R, K/2] uint8 | [.., R, K] float8_e4m3fn
    scale: torch.Tensor | None  # [.., R, K/16] float8_e4m3fn | [.., R, K/32] uint8 | None

    def batch(self) -> int:
        return self.data.shape[0] if self.data.dim() == 3 else 1

    def strides(self):
        """(batch, row, k) strides of data and of scale; batch stride 0 when broadcast."""
        return batch_strides(self.data), batch_strides(
            self.scale if self.scale is not None else self.data)


class Config(NamedTuple):
    bm: int
    bn: int
    bk: int  # elements of K per step (NVFP4 loads bk/2 bytes)
    split: int  # K splits; 1 fuses the epilogue into the GEMM kernel
    warps: int
    stages: int
    group_m: int = 8  # M tiles walked together for L2 reuse of the B tiles


class TmaConfig(NamedTuple):
    """A tile config of the persistent TMA kernel ([Note: persistent TMA GEMM])."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    warp_specialize: bool
    group_m: int = 8


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# Products with more rows than this decode each quantized operand to bf16 once (decode_bf16)
# and run the plain bf16 GEMM; up to it, the weight is decoded in registers while it streams.
DECODE_FIRST_M = 64


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, batch: int, sms: int, codes: bool = False) -> Config:
    """Decode shapes (m <= 64) split K to fill the SMs; larger m uses 128x256 tiles on bf16
    operands, and CODES_CONFIG where a quantized operand is decoded in the kernel (`codes`)."""
    if m <= DECODE_FIRST_M:
        bm = max(16, next_pow2(m))
        bn, bk = 64, 256
        tiles_mn = cdiv(n, bn) * batch
        steps = cdiv(k, bk)
        split = max(1, min(steps // 4, cdiv(4 * sms, tiles_mn)))
        return Config(bm, bn, bk, split, warps=4, stages=4)
    if codes:
        return CODES_CONFIG
    return Config(128, 256, 64, 1, warps=8, stages=4)  # 858 us vs 882 with 3 (sweep, H200)


# [Note: codes in the tiled kernel]
# A product of more than DECODE_FIRST_M rows but fewer than CODES_MAX_MNK multiply-adds runs the
# tiled kernel on its quantized operands' codes, each tile decoded in registers as it loads
# ([Note: exact decode in registers] in tiles.py), instead of decoding each operand to bf16
# first: one launch and one output allocation instead of three launches and three allocations.
# Such products (a small model's training GEMMs: 8192 tokens at width 512) take tens of
# microseconds on the GPU, about what their launches cost on the host, so the launches are what
# a step waits for. The in-register decode repeats for every tile that reads an operand (N / BN
# times for A), which larger products pay on the GPU, so they decode first; so do products of
# fewer output tiles than half the SMs (a small layer's wgrad: 512 x 512 outputs summed over
# 8192 tokens), whose few programs would each decode a long K alone. An operand strided along K
# (the transpose view of MXFP8 columnwise data) is decoded first at any size: its tiles would
# load a byte at a time. 128x128 tiles with 8 warps and 3 stages: 128x256 tiles leave the
# decode no registers (ptxas spills MXFP8's). On an H100, NVFP4 products of 8192 x 256..1408 x
# 512..1408 ran 1.3-3.4x faster a call than decoded first and 2048**3 2.4x, where 4096 x 4096 x
# 1024 (2**34) ran 0.73x and 512 x 512 x 8192 0.65x.
# A product captured into a CUDA graph decodes first: a replay costs only GPU time, and there the
# repeated decode loses. Graphed on an H200, the small GPT's products ran 1.4-2.1x longer on
# codes than decoded first, 2048**3 2.9x; only 8192 x 256 x 512 ran faster (0.8-0.9x).
CODES_MAX_MNK = 1 << 33
CODES_CONFIG = Config(128, 128, 64, 1, warps=8, stages=3)


def takes_codes(a: "Operand", b: "Operand", m: int, n: int, k: int) -> bool:
    """Whether a product of more than DECODE_FIRST_M rows multiplies these operands' codes
    ([Note: codes in the tiled kernel]) rather than their bf16 decodes."""
    if m <= DECODE_FIRST_M or m * n * k >= CODES_MAX_MNK:
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    if a.data.stride(-1) != 1 or b.data.stride(-1) != 1:
        return False
    tiles = cdiv(m, CODES_CONFIG.bm) * cdiv(n, CODES_CONFIG.bn)
    return 2 * tiles >= _sm_count(b.data.device.index or 0)


# [Note: persistent TMA GEMM]
# A product of two bf16 operands [M, K] x [N, K] (a high-precision activation, or quantized
# operands decoded to exact bf16 units by decode_bf16) with more than DECODE_FIRST_M rows and at
# least TMA_MIN_MNK multiply-adds runs `_tma_gemm_kernel` where the GPU has TMA (sm_90+) and the
# operands' rows are 16-byte aligned: one program per SM walks the output tiles (grouped by
# GROUP_M rows of tiles for L2 reuse), the tiles of A and B arrive by TMA into a ring of
# `stages` buffers, Triton's warp specialization puts the loads and the MMAs in separate warps,
# and the epilogue (the same terms and order as `tiles.epilogue`, no FMA contraction) stores
# each half tile by TMA. Out-of-range rows and K columns load as zeros and out-of-range stores
# are dropped, so ragged shapes need no masks. The sums are the same exact products in another
# fp32 order. Other products, and every GPU without TMA, keep the tiled kernel.
# 128x256x64 tiles, 8 warps, 3 stages: of nine configs swept on an H100 at the Llama-8B training
# shapes, the best or within 3 % at each; below 2**33 multiply-adds no config beat the tiled
# kernel (benchmarks/RESULTS.md, "first training session").
TMA_CONFIG = TmaConfig(128, 256, 64, 8, 3, True)
TMA_MIN_MNK = 1 << 33


def tma_problem(a: "Operand", b: "Operand", out_dtype, m: int, n: int, k: int) -> str | None:
    """Why the persistent TMA kernel cannot run this product, or None."""
    if TensorDescriptor is None:
        return "this Triton has no host TMA descriptors"
    if a.fmt != FMT_HP or b.fmt != FMT_HP or a.data.dtype != torch.bfloat16 or \
            b.data.dtype != torch.bfloat16:
        return "both operands must be bf16 (decoded)"
    if a.batch() != 1 or b.batch() != 1:
        return "batched products take the tiled kernel"
    if _capability(b.data.device.index or 0)[0] < 9:
        return "TMA needs sm_90 or newer"
    item = out_dtype.itemsize
    if not (tma_rows(a.data) and tma_rows(b.data)):
        return "an operand's rows are not 16-byte aligned and contiguous"
    if (n * item) % 16:
        return f"the output rows ({n} x {item} bytes) are not 16-byte aligned"
    return None


def tma_rows(t: torch.Tensor) -> bool:
    """Whether a bf16 operand's rows can be TMA tiles: contiguous, 16-byte aligned start and
    row stride."""
    return t.stride(-1) == 1 and (t.stride(-2) * 2) % 16 == 0 and t.data_ptr() % 16 == 0


def _tma_gemm(a: "Operand", b: "Operand", ep: "Epilogue", out_dtype, m: int, n: int, k: int,
              cfg: TmaConfig) -> torch.Tensor:
    out = torch.empty((1, m, n), dtype=out_dtype, device=b.data.device)
    a2, b2 = a.data.reshape(m, a.data.shape[-1]), b.data.reshape(n, b.data.shape[-1])
    a_desc = TensorDescriptor.from_tensor(a2, [cfg.bm, cfg.bk])
    b_desc = TensorDescriptor.from_tensor(b2, [cfg.bn, cfg.bk])
    c_desc = TensorDescriptor.from_tensor(out[0], [cfg.bm, cfg.bn // 2])
    left, _, l_r, inv, right, _, r_c, bias = ep.terms(b.data)
    sms = _sm_count(b.data.device.index or 0)
    programs = min(sms, cdiv(m, cfg.bm) * cdiv(n, cfg.bn))
    _TMA_GEMM(
        (programs,), a_desc, b_desc, c_desc, left, l_r, inv, right, r_c, bias, m, n, k,
        **ep.flags(), BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, PROGRAMS=programs,
        WS=cfg.warp_specialize, num_warps=cfg.warps, num_stages=cfg.stages,
        enable_fp_fusion=False,
    )
    return out


def vector_strides(t: torch.Tensor | None) -> tuple[int, int]:
    """(batch, element) strides of an amax: 0-d, one value per row [R], or [B, R]."""
    if t is None or t.dim() == 0:
        return 0, 0
    if t.dim() == 1:
        return 0, t.stride(0)
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1)


class Epilogue(NamedTuple):
    """The epilogue's terms: acc * (amax_a * inv) (or * inv), then * amax_b, then + bias."""

    amax_a: torch.Tensor | None  # fp32 0-d or one per row of A ([M] / [B, M]); NVFP4 A only
    inv: float | None  # fp32 r(1 / (36 B_a B_b)) or r(1 / (6 B)); None without NVFP4
    amax_b: torch.Tensor | None  # fp32 0-d or one per row of B ([N] / [B, N]); NVFP4 B only
    bias: torch.Tensor | None  # [N] (or [E, N] grouped), any float dtype

    def left_mode(self) -> int:
        return 0 if self.inv is None else (2 if self.amax_a is not None else 1)

    def terms(self, dummy: torch.Tensor) -> tuple:
        """The kernels' epilogue arguments: left ptr and strides, inv, right ptr and strides,
        bias (absent pointers replaced by `dummy`, never read)."""
        l_b, l_r = vector_strides(self.amax_a)
        r_b, r_c = vector_strides(self.amax_b)
        return (self.amax_a if self.amax_a is not None else dummy, l_b, l_r, self.inv or 1.0,
                self.amax_b if self.amax_b is not None else dummy, r_b, r_c,
                self.bias if self.bias is not None else dummy)

    def flags(self) -> dict:
        return dict(LEFT=self.left_mode(), HAS_RIGHT=self.amax_b is not None,
                    HAS_BIAS=self.bias is not None)


def qgemm(a: Operand, b: Operand, ep: Epilogue, *, out_dtype, m: int, n: int, k: int,
          config: Config | TmaConfig | None = None) -> torch.Tensor:
    """[B, M, N] = epilogue(A @ B^T) for operands given as rows along K. `config`: a tiled
    kernel's Config, or a TmaConfig to run the persistent TMA kernel (which must be able to:
    tma_problem); None picks."""
    if isinstance(config, TmaConfig) or (
            config is None and m > DECODE_FIRST_M and m * n * k >= TMA_MIN_MNK and
            tma_problem(a, b, out_dtype, m, n, k) is None):
        return _tma_gemm(a, b, ep, out_dtype, m, n, k, config or TMA_CONFIG)
    tiled = TiledLaunch(a.fmt, a.strides(), b.fmt, b.strides(), max(a.batch(), b.batch()), ep,
                        device=b.data.device, out_dtype=out_dtype, m=m, n=n, k=k, config=config)
    return tiled(a.data, a.scale, b.data, b.scale, ep.amax_a, ep.amax_b, ep.bias)


def takes_tma(m: int, n: int, k: int) -> bool:
    """Whether qgemm, left to pick, tries the persistent TMA kernel for a product of this size
    (it runs there when tma_problem allows)."""
    return m > DECODE_FIRST_M and m * n * k >= TMA_MIN_MNK


class TiledLaunch:
    """The tiled kernel's launch, and the split-K epilogue's where K is split, for one layout of
    a product: config, grid, strides and constexprs are worked out once and each launch is a
    `Bound` one ([Note: direct launch] in launch.py).

    A call takes the tensors of the operands (data, scale), the epilogue's amaxes and the bias.
    They must have the layout of those the launch was made for: the operands' formats and
    strides given here, the epilogue terms present in `ep`, and one dtype and one 16-byte
    alignment per tensor across calls (the caller keys on them). The output is fresh, of
    `out_shape` (any shape of B * M * N elements; default [B, M, N]). The same kernels and
    arguments as a launch made for the call alone, so the same bits."""

    __slots__ = ("device", "index", "out_shape", "out_dtype", "ws_shape", "gemm", "reduce",
                 "a_strides", "b_strides", "left", "right", "sizes", "reduce_sizes")

    def __init__(self, a_fmt: int, a_strides, b_fmt: int, b_strides, batch: int, ep: Epilogue,
                 *, device, out_dtype, m: int, n: int, k: int, config: Config | None = None,
                 out_shape: tuple[int, ...] | None = None):
        self.device, self.index, self.out_dtype = device, device.index or 0, out_dtype
        cfg = config or pick_config(m, n, k, batch, _sm_count(self.index),
                                    a_fmt != FMT_HP or b_fmt != FMT_HP)
        # (batch, row, k) strides of data, then of scale (data's again where there is none).
        self.a_strides, self.b_strides = (*a_strides[0], *a_strides[1]), (*b_strides[0],
                                                                           *b_strides[1])
        l_b, l_r = vector_strides(ep.amax_a)
        self.left, self.right = (l_b, l_r, ep.inv or 1.0), vector_strides(ep.amax_b)
        k_per_split = cdiv(cdiv(k, cfg.split), cfg.bk) * cfg.bk
        split = cdiv(k, k_per_split)
        self.out_shape = out_shape or (batch, m, n)
        self.ws_shape = (split, batch, m, n)
        self.sizes, self.reduce_sizes = (batch, m, n, k, k_per_split), (batch, m, n, split)
        flags = ep.flags()
        self.gemm = _QGEMM.bind(
            (cdiv(m, cfg.bm) * cdiv(n, cfg.bn), split, batch), FMT_A=a_fmt, FMT_B=b_fmt, **flags,
            FUSED=split == 1, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
            num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=False)
        self.reduce = None
        if split > 1:
            eb_m, eb_n = 32, 128
            self.reduce = _SPLITK_EPILOGUE.bind(
                (cdiv(m, eb_m) * cdiv(n, eb_n), batch), **flags, BM=eb_m, BN=eb_n, num_warps=4,
                enable_fp_fusion=False)

    def __call__(self, a_data, a_scale, b_data, b_scale, amax_a, amax_b, bias) -> torch.Tensor:
        dev = self.device
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=dev)
        ws = out if self.reduce is None else torch.empty(self.ws_shape, dtype=torch.float32,
                                                         device=dev)
        dummy = b_data  # stands for every absent pointer; never read
        terms = (amax_a if amax_a is not None else dummy, *self.left,
                 amax_b if amax_b is not None else dummy, *self.right,
                 bias if bias is not None else dummy)
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        self.gemm(stream, a_data, a_scale if a_scale is not None else dummy, *self.a_strides,
                  b_data, b_scale if b_scale is not None else dummy, *self.b_strides, *terms, out,
                  ws, *self.sizes)
        if self.reduce is not None:
            self.reduce(stream, ws, out, *terms, *self.reduce_sizes)
        return out


class Prepared:
    """qgemm(a, b, ep) with everything but the left operand's data bound, for decode shapes
    (a high-precision 2-D left operand of m <= DECODE_FIRST_M rows, a 2-D right operand):
    `prepared(a_data)` multiplies new data of the layout `a.data` had (dtype, row and K
    strides, 16-byte alignment; a_data may be any tensor of that memory layout, e.g. the
    [B, S, K] activation that `a.data` is the [B * S, K] view of) by the same right operand and
    epilogue, into a fresh output of `out_shape` (default [M, N]). A `TiledLaunch` holds the
    launches, so a call costs the output allocations and the kernel launches: the same kernels,
    arguments and results as `qgemm`."""

    __slots__ = ("tiled", "b", "ep")

    def __init__(self, a: Operand, b: Operand, ep: Epilogue, *, out_dtype, m: int, n: int, k: int,
                 out_shape: tuple[int, ...] | None = None):
        if a.fmt != FMT_HP or a.data.dim() != 2 or b.data.dim() != 2 or m > DECODE_FIRST_M:
            raise ValueError(
                f"Prepared takes a high-precision 2-D left operand of at most {DECODE_FIRST_M} "
                f"rows and a 2-D right one; got {tuple(a.data.shape)} (format {a.fmt}) x "
                f"{tuple(b.data.shape)}.")
        self.b, self.ep = b, ep
        self.tiled = TiledLaunch(a.fmt, a.strides(), b.fmt, b.strides(), 1, ep,
                                 device=b.data.device, out_dtype=out_dtype, m=m, n=n, k=k,
                                 out_shape=out_shape or (m, n))

    def __call__(self, a_data: torch.Tensor) -> torch.Tensor:
        b, ep = self.b, self.ep
        return self.tiled(a_data, None, b.data, b.scale, None, ep.amax_b, ep.bias)


def decode_bf16(x: Operand, rows: int, k: int) -> Operand:
    """The exact bf16 unit values [B, R, K] of a quantized operand (one streaming pass).

    Large products decode each operand once and then run the plain bf16 GEMM: decoding inside
    the K loop repeats the work for every tile that reads the operand (N / BN times for A).
    """
    if x.fmt == FMT_HP:
        return x
    return Operand(FMT_HP, DecodeLaunch(x, rows, k)(x.data, x.scale), None)


class DecodeLaunch:
    """decode_bf16's launch for one operand layout (format, strides, batch), worked out once;
    a call takes data and scale tensors of that layout (one dtype and 16-byte alignment each
    across calls) and returns their fresh bf16 decode [B, R, K]."""

    __slots__ = ("device", "index", "shape", "launch", "args")

    def __init__(self, x: Operand, rows: int, k: int):
        batch = x.batch()
        self.device, self.index = x.data.device, x.data.device.index or 0
        (d_b, d_r, d_k), (s_b, s_r, s_k) = x.strides()
        self.shape, self.args = (batch, rows, k), (d_b, d_r, d_k, s_b, s_r, s_k)
        br, bk = 32, 256
        self.launch = _DECODE.bind((cdiv(rows, br), cdiv(k, bk), batch), FMT=x.fmt, BR=br, BK=bk,
                                   num_warps=4)

    def __call__(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.bfloat16, device=self.device)
        self.launch(torch._C._cuda_getCurrentRawStream(self.index), data, scale, *self.args, out,
                    *self.shape[1:])
        return out


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


@triton.jit
def _tma_gemm_kernel(
    a_desc, b_desc, c_desc, left_ptr, l_r, inv, right_ptr, r_c, bias_ptr, M, N, K,
    LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    WS: tl.constexpr,
):
    """[Note: persistent TMA GEMM]: program p computes tiles p, p + PROGRAMS, ..."""
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True,
                         warp_specialize=WS):
        group = GROUP_M * num_n
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        off_m = (first_m + (tile % group) % size_m) * BM
        off_n = ((tile % group) // size_m) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([off_m, kt * BK])
            b = b_desc.load([off_n, kt * BK])
            acc = tl.dot(a, b.T, acc)
        rows = off_m + tl.arange(0, BM)
        rmask = rows < M
        halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(halves)
        cols = off_n + tl.arange(0, BN // 2)
        acc0 = tiles.epilogue(acc0, rows, cols, rmask, cols < N, left_ptr, l_r, inv, right_ptr,
                              r_c, bias_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
        c_desc.store([off_m, off_n], acc0.to(c_desc.dtype))
        cols = cols + BN // 2
        acc1 = tiles.epilogue(acc1, rows, cols, rmask, cols < N, left_ptr, l_r, inv, right_ptr,
                              r_c, bias_ptr, LEFT, HAS_RIGHT, HAS_BIAS)
        c_desc.store([off_m, off_n + BN // 2], acc1.to(c_desc.dtype))


_QGEMM = Launcher(_qgemm_kernel)
_SPLITK_EPILOGUE = Launcher(_splitk_epilogue_kernel)
_DECODE = Launcher(_decode_kernel)
_TMA_GEMM = Launcher(_tma_gemm_kernel)
