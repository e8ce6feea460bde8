"""The operands of the GEMM ops as they take them, and what every implementation shares.

A `Side` is one operand (data, scale, amax, bound); `pack_args` / `unpack_args` put two of them
in an op's schema order and back ([Note: GEMM ops] in qtensor/ops/gemm_ops.py has the schemas).
`units` gives the exact fp32 values a GEMM multiplies and `epilogue_factors` / `apply_epilogue`
the epilogue of [Note: emulated GEMM] (qtensor/gemm/dense.py), in its order. The argument checks
here run in every implementation of an op, the fake one included, so a bad call fails the
same way eagerly, under torch.compile and on every device.
"""

from __future__ import annotations

import torch

from qtensor.formats import fp8_block as fp8_block_ref
from qtensor.formats import mxfp4 as mxfp4_ref
from qtensor.formats import mxfp8 as mxfp8_ref
from qtensor.formats import nvfp4 as nvfp4_ref
from qtensor.formats.elements import fdiv
from qtensor.formats.fields import either

NVFP4, MXFP8, FP8_BLOCK, MXFP4 = "nvfp4", "mxfp8", "fp8_block", "mxfp4"
# Formats with no Triton kernel: their ops run the exact reference on the GPU (MXFP4's take the
# CPU kernels on the CPU, qtensor/ops/gemm_ops.py [Note: CPU GEMM kernel]).
NO_KERNEL = (FP8_BLOCK, MXFP4)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# r(1 / denom) in fp32 for every epilogue denominator (36 B_a B_b, or 6 B with one NVFP4
# operand, B one of the NVFP4 E4M3 bounds), computed once at import as Python floats holding
# exact fp32 values: no product builds a device tensor for them, and torch.compile sees
# constants. A fp32 tensor times such a float rounds once, exactly as a tensor-tensor multiply
# does.
BOUNDS = nvfp4_ref.E4M3_BOUNDS
INV = {
    d: fdiv(1.0, torch.tensor(d)).item()
    for d in {6.0 * a * 6.0 * b for a in BOUNDS for b in BOUNDS} | {6.0 * b for b in BOUNDS}
}


FP8_ROWS = fp8_block_ref.FP8BlockSpec("1x128")
FP8_TILES = fp8_block_ref.FP8BlockSpec("128x128")


# ---- operands and the epilogue ----------------------------------------------------------------


class Side:
    """One operand as the ops take it: data, scale (None: high precision), amax and bound
    (NVFP4), tiles (FP8 block: 128x128 tile scales instead of 1x128 block scales)."""

    __slots__ = ("data", "scale", "amax", "bound", "tiles")

    def __init__(self, data, scale=None, amax=None, bound=448, tiles=False):
        self.data, self.scale, self.amax, self.bound = data, scale, amax, bound
        self.tiles = tiles

    @property
    def quantized(self) -> bool:
        return self.scale is not None


def pack_args(fmt: str, a: Side, b: Side, bias, out_dtype, offs=None) -> tuple:
    """The arguments of a dense op (offs None) or a grouped op, in schema order."""
    if fmt == FP8_BLOCK:  # dense only; only the right operand may hold tiles
        return a.data, a.scale, b.data, b.scale, b.tiles, bias, out_dtype
    if fmt == NVFP4:
        head, bounds = (a.data, a.scale, a.amax, b.data, b.scale, b.amax), (a.bound, b.bound)
    else:
        head, bounds = (a.data, a.scale, b.data, b.scale), ()
    return (*head, *(() if offs is None else (offs,)), *bounds, bias, out_dtype)


def unpack_args(fmt: str, args, grouped: bool):
    """(a, b, offs, bias, out_dtype) of an op's arguments: pack_args read backwards."""
    n = 6 if fmt == NVFP4 else 4
    head, rest = args[:n], list(args[n:])
    offs = rest.pop(0) if grouped else None
    if fmt == NVFP4:
        a, b = Side(*head[:3], rest.pop(0)), Side(*head[3:], rest.pop(0))
    else:
        a, b = Side(*head[:2]), Side(*head[2:])
    bias, out_dtype = rest
    return a, b, offs, bias, out_dtype


# Where the two operands sit in an op's arguments (the bias is always second to last).
B_POSITION = {NVFP4: 3, MXFP8: 2, MXFP4: 2}


def reduction_k(fmt: str, side: Side) -> int:
    """The reduction length K an operand stands for."""
    k = side.data.shape[-1]
    return 2 * k if fmt in (NVFP4, MXFP4) and side.quantized else k  # two codes a byte


def units(fmt: str, side: Side) -> torch.Tensor:
    """The exact fp32 values [.., R, K] a GEMM multiplies: NVFP4 value(q) * s_b, MXFP8
    e4m3 * 2**(code - 127), MXFP4 value(q) * 2**(code - 127), a high-precision operand as
    itself."""
    if not side.quantized:
        return side.data.float()
    if fmt == NVFP4:
        return nvfp4_ref.unit_values(side.data, side.scale)
    if fmt == MXFP4:
        return mxfp4_ref.dequantize(side.data, side.scale)
    if fmt == FP8_BLOCK:
        return fp8_block_ref.dequantize(side.data, side.scale, FP8_TILES if side.tiles else
                                        FP8_ROWS)
    return mxfp8_ref.dequantize(side.data, side.scale, columnwise=False)


def epilogue_terms(fmt: str, a: Side, b: Side):
    """(amax_a or None, inv or None, amax_b or None): each NVFP4 operand's amax and
    inv = r(1 / (36 B_a B_b)), or r(1 / (6 B)) with one NVFP4 operand; all None for MXFP8."""
    if fmt != NVFP4:
        return None, None, None
    denom = (6.0 * a.bound if a.quantized else 1.0) * (6.0 * b.bound if b.quantized else 1.0)
    return (a.amax if a.quantized else None), INV[denom], (b.amax if b.quantized else None)


def epilogue_factors(fmt: str, a: Side, b: Side):
    """(left, right) fp32 multipliers shaped for the output: left = A_a * inv (or inv) as a
    scalar or [.., M, 1], right = A_b as a scalar or [.., 1, N]; None for MXFP8."""
    amax_a, inv, amax_b = epilogue_terms(fmt, a, b)
    if inv is None:
        return None, None
    left = inv if amax_a is None else (amax_a if amax_a.dim() == 0 else amax_a[..., None]) * inv
    right = None if amax_b is None else (amax_b if amax_b.dim() == 0 else amax_b[..., None, :])
    return left, right


def fresh_reshape(t: torch.Tensor, shape) -> torch.Tensor:
    """t (contiguous, a GEMM's output) with `shape`, as a tensor of its own rather than a view:
    what nn.Linear returns, so an in-place op on it never trips autograd's view checks."""
    if tuple(t.shape) == tuple(shape):
        return t
    return torch.ops.aten._unsafe_view(t, shape)


def apply_epilogue(acc, left, right, bias, out_dtype) -> torch.Tensor:
    """acc * left, then * right, then + bias, then the cast: [Note: emulated GEMM]'s order."""
    if left is not None:
        acc = acc * left
    if right is not None:
        acc = acc * right
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


# ---- argument checks (shared by every implementation, the fake one included) -----------------

# Per format: (data dtype, scale dtype) of a quantized operand, and data columns per scale
# column (NVFP4: 16 elements = 8 bytes; MXFP8: 32 elements = 32 bytes; MXFP4: 32 = 16 bytes).
_QUANTIZED_OPERAND = {
    NVFP4: ((torch.uint8, torch.float8_e4m3fn), 8),
    MXFP8: ((torch.float8_e4m3fn, torch.float8_e8m0fnu), 32),
    MXFP4: ((torch.uint8, torch.uint8), 16),
}


def _fail(op: str, what: str) -> None:
    raise ValueError(f"qtensor::{op}: {what}")


def _check_side(op: str, fmt: str, name: str, s: Side, experts=None) -> None:
    """`experts`: E for an operand whose NVFP4 amax is per expert ([E], or [E, R] row-scaled),
    else None (0-d or [.., R])."""
    d = s.data
    if d.dim() not in (2, 3):
        _fail(op, f"operand {name} must be 2-D or 3-D rows along K; got shape {tuple(d.shape)}.")
    if not s.quantized:
        if d.dtype not in FLOAT_DTYPES:
            _fail(op, f"a high-precision operand {name} must be float32, bfloat16 or float16; "
                      f"got {d.dtype}.")
        return
    want, block = _QUANTIZED_OPERAND[fmt]
    if d.dtype != want[0] or s.scale.dtype != want[1]:
        _fail(op, f"{fmt} operand {name} needs {want[0]} data and {want[1]} scales; got "
                  f"{d.dtype} and {s.scale.dtype}.")
    if tuple(s.scale.shape[:-1]) != tuple(d.shape[:-1]) or s.scale.shape[-1] * block != d.shape[-1]:
        _fail(op, f"{name}_scale must be {(*d.shape[:-1], d.shape[-1] // block)} for data "
                  f"{tuple(d.shape)}; got {tuple(s.scale.shape)}.")
    if fmt == NVFP4:
        amax = s.amax
        if amax is None or amax.dtype != torch.float32:
            _fail(op, f"an NVFP4 operand {name} needs an fp32 {name}_amax; got "
                      f"{None if amax is None else amax.dtype}.")
        if experts is not None:
            if tuple(amax.shape) not in ((experts,), (experts, *d.shape[:-1])):
                _fail(op, f"{name}_amax must be one value per expert [{experts}] or per expert "
                          f"and row {(experts, *d.shape[:-1])}; got {tuple(amax.shape)}.")
        elif amax.dim() and tuple(amax.shape) != tuple(d.shape[:-1]):
            _fail(op, f"{name}_amax must be 0-d or one value per row {tuple(d.shape[:-1])}; "
                      f"got {tuple(amax.shape)}.")
        if s.bound not in BOUNDS:
            _fail(op, f"{name}_bound must be {either(BOUNDS)}; got {s.bound}.")


def _check_pair(op: str, fmt: str, a: Side, b: Side, out_dtype, experts=None) -> None:
    """What every op asks of its two operands: valid sides, one K, one device, a float output."""
    _check_side(op, fmt, "a", a, experts)
    _check_side(op, fmt, "b", b, experts)
    if reduction_k(fmt, a) != reduction_k(fmt, b):
        _fail(op, f"K differs: a {tuple(a.data.shape)} x b {tuple(b.data.shape)} (rows along K).")
    if a.data.device != b.data.device:
        _fail(op, f"operands on different devices: {a.data.device} and {b.data.device}.")
    if out_dtype not in FLOAT_DTYPES:
        _fail(op, f"out_dtype must be float32, bfloat16 or float16; got {out_dtype}.")


def check_dense(op: str, fmt: str, a: Side, b: Side, bias, out_dtype) -> None:
    if not (a.quantized or b.quantized):
        _fail(op, "at least one operand must be quantized (a_scale or b_scale given).")
    _check_pair(op, fmt, a, b, out_dtype)
    if a.data.dim() == b.data.dim() == 3 and 1 != a.data.shape[0] != b.data.shape[0] != 1:
        _fail(op, f"batch sizes differ: {a.data.shape[0]} x {b.data.shape[0]}.")


def check_grouped(op: str, fmt: str, a: Side, b: Side, offs, bias, out_dtype) -> None:
    if a.data.dim() != 2 or b.data.dim() != 3:
        _fail(op, f"takes tokens a [T, K*] x experts b [E, N, K*]; got {tuple(a.data.shape)} x "
                  f"{tuple(b.data.shape)}.")
    _check_pair(op, fmt, a, b, out_dtype)
    experts = b.data.shape[0]
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != experts:
        _fail(op, f"offs must be int32 [E] with E = {experts} cumulative row ends; got "
                  f"{offs.dtype} {tuple(offs.shape)}.")
    if bias is not None and tuple(bias.shape) != (experts, b.data.shape[1]):
        _fail(op, f"bias must be [E, N] = {(experts, b.data.shape[1])}; got {tuple(bias.shape)}.")


def check_grouped_k(op: str, fmt: str, a: Side, b: Side, offs, out_dtype) -> None:
    """A product grouped along K: a [M, K*] and b [N, K*], both quantized, expert e owning the
    K positions [offs[e-1], offs[e]) and its own amaxes."""
    if not (a.quantized and b.quantized):
        _fail(op, "both operands must be quantized (a_scale and b_scale given).")
    if a.data.dim() != 2 or b.data.dim() != 2:
        _fail(op, f"takes a [M, K*] x b [N, K*], rows along K; got {tuple(a.data.shape)} x "
                  f"{tuple(b.data.shape)}.")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] == 0:
        _fail(op, f"offs must be int32 [E], E >= 1 cumulative ends along K; got {offs.dtype} "
                  f"{tuple(offs.shape)}.")
    _check_pair(op, fmt, a, b, out_dtype, experts=offs.shape[0])


def dense_shape(a: Side, b: Side) -> tuple[int, ...]:
    m, n = a.data.shape[-2], b.data.shape[-2]
    if a.data.dim() == b.data.dim() == 2:
        return (m, n)
    batch = max(a.data.shape[0] if a.data.dim() == 3 else 1,
                b.data.shape[0] if b.data.dim() == 3 else 1)
    return (batch, m, n)


def check_fp8_block(a, a_scale, b, b_scale, b_tiles: bool, bias, out_dtype) -> None:
    op, blk = "fp8_block_mm", fp8_block_ref.BLOCK
    for name, d, sc in (("a", a, a_scale), ("b", b, b_scale)):
        if d.dim() != 2 or d.dtype != torch.float8_e4m3fn or sc.dtype != torch.float32:
            _fail(op, f"operand {name} must be 2-D float8_e4m3fn rows along K with float32 "
                      f"scales; got {d.dtype} {tuple(d.shape)} and {sc.dtype} scales.")
        if d.shape[-1] % blk:
            _fail(op, f"K must be a multiple of {blk}; operand {name} has {tuple(d.shape)}.")
    if a.shape[1] != b.shape[1]:
        _fail(op, f"K differs: a {tuple(a.shape)} x b {tuple(b.shape)} (rows along K).")
    k_blocks = a.shape[1] // blk
    if tuple(a_scale.shape) != (a.shape[0], k_blocks):
        _fail(op, f"a_scale must be 1x128 blocks {(a.shape[0], k_blocks)}; got "
                  f"{tuple(a_scale.shape)}.")
    if b_tiles and b.shape[0] % blk:
        _fail(op, f"128x128 tiles need N a multiple of {blk}; b has {tuple(b.shape)}.")
    want = (b.shape[0] // blk if b_tiles else b.shape[0], k_blocks)
    if tuple(b_scale.shape) != want:
        _fail(op, f"b_scale must be {'128x128 tiles' if b_tiles else '1x128 blocks'} {want}; "
                  f"got {tuple(b_scale.shape)}.")
    if a.device != b.device:
        _fail(op, f"operands on different devices: {a.device} and {b.device}.")
    if bias is not None and tuple(bias.shape) != (b.shape[0],):
        _fail(op, f"bias must be a vector [N] = [{b.shape[0]}]; got {tuple(bias.shape)}.")
    if out_dtype not in FLOAT_DTYPES:
        _fail(op, f"out_dtype must be float32, bfloat16 or float16; got {out_dtype}.")
