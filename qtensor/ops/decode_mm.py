"""qtensor::decode_mm: a high-precision activation times a weight in the decode layout.

    qtensor::decode_mm(Tensor x, Tensor w, Tensor s, Tensor? amax, Tensor? bias, str fmt,
                       int n, int k, int bound, ScalarType out_dtype) -> Tensor

x is [M, K]; (w, s) are the weight [N, K]'s codes and scales in the decode layout
([Note: decode layout], qtensor/formats/decode_layout.py) of `fmt` ("nvfp4", "mxfp4",
"mxfp8"); amax and bound are NVFP4's per-tensor (0-d) or per-row ([N]) amax and E4M3 bound. The
result is out[M, N] = epilogue(x @ W^T), the epilogue of [Note: emulated GEMM] (a weight-only
product: acc * r(1 / (6 B)) * amax for NVFP4, then + bias).

Implementations:
- CPU: the canonical weight's CPU product (`gemm_ops.cpu_mm`, [Note: CPU GEMM kernel]) on
  the canonical bytes `unpack` gives back, so a packed and a canonical weight give the same
  bits; the CUDA fallback: the exact reference on those bytes.
- CUDA: the decode GEMM of csrc/decode_gemm_cuda.cu ([Note: decode GEMM]) for a bf16
  activation (fp16 too with NVFP4 weights, whose unit values fp16 holds exactly). Up to
  DECODE_M rows in one launch; up to CHUNKED_M[fmt] rows (any number for MXFP4) in launches of
  DECODE_M rows, each streaming the weight again. Above that, and for what the kernel does not
  take (an fp16 activation with an MX weight, an fp32 one, a GPU without the kernel), the
  weight is unpacked for the call (qtensor::decode_unpack) and the canonical product runs: the
  dense Triton kernels where they take it (NVFP4 and MXFP8 with a bf16 activation), else the
  reference.
- Meta: the output's shape and dtype. Autograd: the gradient of x and of the bias.
"""

from __future__ import annotations

import functools

import torch

from qtensor.backends import has_kernel, has_ops
from qtensor.formats import decode_layout
from qtensor.ops import gemm_ops, gemm_triton
from qtensor.ops.gemm_operands import BOUNDS, FLOAT_DTYPES, INV, Side, apply_epilogue, units

SCHEMA = ("(Tensor x, Tensor w, Tensor s, Tensor? amax, Tensor? bias, str fmt, int n, int k, "
          "int bound, ScalarType out_dtype) -> Tensor")
DECODE_M = 64  # rows one launch of the decode kernel takes
# Rows up to which launches of DECODE_M rows beat unpacking the weight for the dense Triton
# kernel, per format. On the H200 (benchmarks/RESULTS.md, "the decode GEMM, activation by
# cp.async") one launch at 64 rows takes 0.41-0.62x the unpack + dense product (NVFP4) and
# 0.62-0.83x (MXFP8) on the benchmark's shapes; two launches at 128 rows win on two of the three
# shapes and lose by 13-27 % on 28672x8192, and more launches lose. MXFP4 has no dense kernel
# (its canonical product is the emulated reference), so its launches run at any M.
CHUNKED_M = {"nvfp4": 128, "mxfp4": None, "mxfp8": 128}
_CANONICAL_DTYPES = {"nvfp4": (torch.uint8, torch.float8_e4m3fn),
                     "mxfp4": (torch.uint8, torch.uint8),
                     "mxfp8": (torch.float8_e4m3fn, torch.float8_e8m0fnu)}


@functools.lru_cache(maxsize=None)
def _unpack_kernel_on(device: torch.device) -> bool:
    """Whether the CUDA unpack kernel runs on `device` (chosen once per device)."""
    return torch.device(device).type == "cuda" and has_kernel("decode_unpack", "CUDA")


def unpack(fmt: str, w, s, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical (data, scale) uint8 bytes of a packed weight: qtensor::decode_unpack on a
    GPU where the extension has it (one pass at memory speed), else the reference,
    decode_layout.unpack (the same bytes: tests/test_decode_gemm.py)."""
    if _unpack_kernel_on(w.device):  # the op refuses scales on another device
        decode_layout.check(fmt, n, k)
        return torch.ops.qtensor.decode_unpack.default(w, s, decode_layout.FORMATS.index(fmt),
                                                        n, k)
    return decode_layout.unpack(fmt, w, s, n, k)


def canonical(fmt: str, w, s, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical (codes, scales) of a packed weight, in the dtypes the GEMM ops take."""
    data, scale = unpack(fmt, w, s, n, k)
    data_dtype, scale_dtype = _CANONICAL_DTYPES[fmt]
    return data.view(data_dtype), scale.view(scale_dtype)


def weight_side(fmt, w, s, amax, n, k, bound) -> Side:
    data, scale = canonical(fmt, w, s, n, k)
    return Side(data, scale, amax, bound)


def _check(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> None:
    decode_layout.check(fmt, n, k)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"qtensor::decode_mm takes a float activation [M, K = {k}]; got "
                         f"{x.dtype} {tuple(x.shape)}.")
    sizes = decode_layout.packed_sizes(fmt, n, k)
    if w.dtype != torch.uint8 or s.dtype != torch.uint8 or (w.numel(), s.numel()) != sizes:
        raise ValueError(f"qtensor::decode_mm: a {fmt} [{n}, {k}] weight in the decode layout "
                         f"is {sizes[0]} code and {sizes[1]} scale bytes (uint8); got "
                         f"{w.dtype} {w.numel()} and {s.dtype} {s.numel()}.")
    if (amax is not None) != (fmt == "nvfp4"):
        raise ValueError(f"qtensor::decode_mm: an amax goes with NVFP4 weights only; fmt {fmt}, "
                         f"amax {'given' if amax is not None else 'missing'}.")
    if amax is not None and (amax.dtype != torch.float32 or
                             tuple(amax.shape) not in ((), (n,))):
        raise ValueError(f"qtensor::decode_mm: the NVFP4 amax is float32, 0-d or [N = {n}]; "
                         f"got {amax.dtype} {tuple(amax.shape)}.")
    if fmt == "nvfp4" and bound not in BOUNDS:
        raise ValueError(f"qtensor::decode_mm: the E4M3 bound is 448 or 256; got {bound}.")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"qtensor::decode_mm: the bias is [N = {n}]; got {tuple(bias.shape)}.")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"qtensor::decode_mm writes float32, bfloat16 or float16; got "
                         f"{out_dtype}.")


def reference(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> torch.Tensor:
    _check(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
    return gemm_ops.reference_mm(fmt, Side(x), weight_side(fmt, w, s, amax, n, k, bound), bias,
                                 out_dtype)


def cpu(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> torch.Tensor:
    """The canonical weight's CPU product on the unpacked bytes (`gemm_ops.cpu_mm`): a packed
    and a canonical weight give the same bits on the CPU."""
    _check(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
    return gemm_ops.cpu_mm(fmt, Side(x), weight_side(fmt, w, s, amax, n, k, bound), bias,
                           out_dtype)


@functools.lru_cache(maxsize=None)
def device_kernel_problem(device: torch.device, fmt: str) -> str | None:
    """Why no decode kernel multiplies `fmt` weights on `device` (chosen once per device), or
    None: the layout `auto` packs a weight exactly where this is None."""
    if fmt not in decode_layout.FORMATS:
        return f"the decode layout holds {', '.join(decode_layout.FORMATS)}; got {fmt}"
    if torch.device(device).type != "cuda":
        return "the decode kernel is a CUDA kernel"
    if not has_kernel("decode_gemm", "CUDA"):
        return "the extension has no CUDA decode kernel (built without nvcc or from an older tree)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "the kernel uses thread-block clusters (sm_90+)"
    return None


def kernel_problem(x, fmt, out_dtype) -> str | None:
    """Why the CUDA decode kernel cannot run this product (the reference then does), or None."""
    problem = device_kernel_problem(x.device, fmt)
    if problem:
        return problem
    if x.dtype != torch.bfloat16 and not (x.dtype == torch.float16 and fmt == "nvfp4"):
        return (f"the kernel multiplies bfloat16 activations (float16 with NVFP4 weights); got "
                f"{x.dtype}")
    return None


# The kernel's tiles for 33-64 rows (qtensor::decode_gemm's `tile`, [Note: decode GEMM]):
# TILE_AUTO lets it choose (the warpgroup tile for MXFP8 and for 4-bit weights of 2**27
# elements or more where an sm_90a build runs on compute capability 9.0, else the m16n8k16
# tiles); the others ask for one, for tests and benchmarks: the m16n8k16 tiles or the warpgroup
# tile, each with 64 or 128 weight rows a CTA (the m16n8k16 tile of 128 rows takes 4-bit weights
# only).
TILE_AUTO, TILE_MMA, TILE_WGMMA_64, TILE_WGMMA_128, TILE_MMA_128 = 0, 1, 2, 3, 4
TILES = {"m16n8k16, 64 rows": TILE_MMA, "m16n8k16, 128 rows": TILE_MMA_128,
         "warpgroup, 64 rows": TILE_WGMMA_64, "warpgroup, 128 rows": TILE_WGMMA_128}


def tile_problem(tile: int, fmt: str) -> str | None:
    """Why a forced `tile` (one of TILES) does not run `fmt` weights on the current CUDA device,
    or None: the warpgroup tile needs compute capability 9.0 (and the sm_90a build the GPU
    machine makes), the m16n8k16 tile of 128 rows 4-bit weights. The kernel refuses both."""
    if tile in (TILE_WGMMA_64, TILE_WGMMA_128) and torch.cuda.get_device_capability() != (9, 0):
        return "the warpgroup tile runs on compute capability 9.0"
    if tile == TILE_MMA_128 and fmt == "mxfp8":
        return "the m16n8k16 tile of 128 rows takes 4-bit weights"
    return None


def _launch(x, w, s, amax, bias, fmt, n, k, bound, out_dtype, splits=0, tile=TILE_AUTO,
            pdl=True):
    """One launch of the decode kernel. `splits` and `tile` 0 let it choose; `pdl` lets a
    launch of up to 16 rows (32 for MXFP8 weights and 4-bit ones of more than 2**24 elements)
    overlap the end of the previous kernel on the stream ([Note: decode GEMM], "Launch"), and
    False (for benchmarks) makes it start only once that kernel has completed."""
    inv = INV[6.0 * bound] if fmt == "nvfp4" else 1.0
    return torch.ops.qtensor.decode_gemm.default(
        x, w, s, amax, bias, decode_layout.FORMATS.index(fmt), n, k, inv, splits, out_dtype,
        tile, pdl)


def kernel_path(fmt: str, m: int) -> str:
    """How the CUDA op multiplies m activation rows by a `fmt` weight where the decode kernel
    takes the product: "decode" (one launch), "chunked" (launches of DECODE_M rows) or
    "unpack" (the canonical product on the weight unpacked for the call)."""
    if m <= DECODE_M:
        return "decode"
    limit = CHUNKED_M[fmt]
    return "chunked" if limit is None or m <= limit else "unpack"


def cuda(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> torch.Tensor:
    _check(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
    m = x.shape[0]
    path = kernel_path(fmt, m)
    if x.numel() and kernel_problem(x, fmt, out_dtype) is None and path != "unpack":
        if path == "decode":
            return _launch(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
        return torch.cat([_launch(x[i:i + DECODE_M], w, s, amax, bias, fmt, n, k, bound,
                                  out_dtype) for i in range(0, m, DECODE_M)])
    return unpacked_mm(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)


def unpacked_mm(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> torch.Tensor:
    """The canonical bytes' product: the dense Triton kernels where they take it, else the
    reference (the weight is unpacked for this call)."""
    b = weight_side(fmt, w, s, amax, n, k, bound)
    if fmt in gemm_ops.NO_KERNEL or gemm_triton.triton_problem(Side(x), b, bias, out_dtype) or \
            not gemm_triton.device_ok(Side(x)):
        return gemm_ops.reference_mm(fmt, Side(x), b, bias, out_dtype)
    return gemm_triton.triton_mm(fmt, Side(x), b, bias, out_dtype)


def fake(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> torch.Tensor:
    _check(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
    return x.new_empty((x.shape[0], n), dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    x, w, s, amax, bias, fmt, n, k, bound, _ = inputs
    ctx.save_for_backward(x, w, s, amax, bias)
    ctx.meta = (fmt, n, k, bound)


def _backward(ctx, grad):
    """dx = (dY * r(1 / (6 B)) * amax) @ units(W) in fp32, then x's dtype; d bias = sum of dY."""
    x, w, s, amax, bias = ctx.saved_tensors
    fmt, n, k, bound = ctx.meta
    b = weight_side(fmt, w, s, amax, n, k, bound)
    left, right = gemm_ops.epilogue_factors(fmt, Side(x), b)
    dx = dbias = None
    if ctx.needs_input_grad[0]:
        d = apply_epilogue(grad.float(), left, right, None, torch.float32)
        dx = (d @ units(fmt, b)).to(x.dtype)
    if bias is not None and ctx.needs_input_grad[4]:
        dbias = grad.float().sum(0).to(bias.dtype)
    return dx, None, None, None, dbias, None, None, None, None, None


def _unpack_fake(w, s, fmt, n, k):
    data, scale = decode_layout.canonical_shapes(decode_layout.FORMATS[fmt], n, k)
    return w.new_empty(data), w.new_empty(scale)


if has_ops("decode_unpack"):
    torch.library.register_fake("qtensor::decode_unpack", _unpack_fake)

_LIB = torch.library.Library("qtensor", "FRAGMENT")
_LIB.define("decode_mm" + SCHEMA)
_LIB.impl("decode_mm", cpu, "CPU")
_LIB.impl("decode_mm", cuda, "CUDA")
torch.library.register_fake("qtensor::decode_mm", fake, lib=_LIB)
torch.library.register_autograd("qtensor::decode_mm", _backward, setup_context=_setup_context,
                                lib=_LIB)
KERNELS = {"cpu": cpu, "cuda": cuda}


def decode_mm(x, w, s, amax, bias, fmt, n, k, bound, out_dtype) -> torch.Tensor:
    """torch.ops.qtensor.decode_mm(...); in plain eager, its device kernel called directly."""
    args = (x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
    device = x.device.type
    if device in KERNELS and gemm_ops._direct_ok(t for t in args if isinstance(t, torch.Tensor)):
        return KERNELS[device](*args)
    return torch.ops.qtensor.decode_mm.default(*args)
