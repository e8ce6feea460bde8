"""The GEMM operators: one torch.library op per product family, over the operands' bytes.

[Note: GEMM ops]
    qtensor::nvfp4_mm(Tensor a, Tensor? a_scale, Tensor? a_amax, Tensor b, Tensor? b_scale,
                      Tensor? b_amax, int a_bound, int b_bound, Tensor? bias,
                      ScalarType out_dtype) -> Tensor
    qtensor::mxfp8_mm(Tensor a, Tensor? a_scale, Tensor b, Tensor? b_scale, Tensor? bias,
                      ScalarType out_dtype) -> Tensor
    qtensor::nvfp4_grouped_mm(Tensor a, Tensor? a_scale, Tensor? a_amax, Tensor b,
                              Tensor b_scale, Tensor b_amax, Tensor offs, int a_bound,
                              int b_bound, Tensor? bias, ScalarType out_dtype) -> Tensor
    qtensor::mxfp8_grouped_mm(Tensor a, Tensor? a_scale, Tensor b, Tensor b_scale, Tensor offs,
                              Tensor? bias, ScalarType out_dtype) -> Tensor
    qtensor::fp8_block_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool b_tiles,
                          Tensor? bias, ScalarType out_dtype) -> Tensor
    qtensor::mxfp4_mm, qtensor::mxfp4_grouped_mm: the schemas of mxfp8_mm, mxfp8_grouped_mm

Both operands come as "rows along K": a is [.., M, K*], b is [.., N, K*], and the dense ops
compute out[.., m, n] = epilogue(sum_k A[.., m, k] * B[.., n, k]) ([Note: emulated GEMM] in
qtensor/gemm/dense.py has the epilogue and its order). A side is quantized exactly when its scale
is given:
- NVFP4: packed E2M1 codes uint8 [.., R, K/2], E4M3 block scales [.., R, K/16], an fp32 amax
  (0-d, or [.., R] when row-scaled) and its E4M3 bound (448 or 256);
- MXFP8: E4M3 data [.., R, K], UE8M0 scales float8_e8m0fnu [.., R, K/32];
- MXFP4: packed E2M1 codes uint8 [.., R, K/2] (element 2j in the low nibble), UE8M0 scale
  codes uint8 [.., R, K/32] ([Note: MXFP4 storage] in qtensor/formats/mxfp4.py);
- otherwise a high-precision float tensor [.., R, K] (its bound argument is ignored).
- FP8 block (the FP8 host of MXFP4 QAT, qtensor/formats/fp8_block.py): E4M3 data [R, K] and
  fp32 power-of-two scales, 1x128 blocks [R, K/128]; b's may instead be 128x128 tiles
  [N/128, K/128] (b_tiles). Both sides are quantized and 2-D.
At least one side of a dense op is quantized; a grouped op's right operand always is. Dense
operands are 2-D or 3-D (a batch of 1 broadcasts) and the output is 2-D when both are. A
grouped op multiplies tokens a [T, K*] by experts b [E, N, K*], expert e owning rows
[offs[e-1], offs[e]) (offs int32 [E], cumulative); bias is [E, N] and rows past offs[-1] are 0.

Implementations:
- CPU: the C++ kernels of csrc/gemm_cpu.cpp where the extension is built ([Note: CPU GEMM
  kernel]), else the exact reference (`reference_mm`, `reference_grouped_mm`): fp32 unit values,
  torch.matmul, the epilogue.
- CUDA: the Triton kernels of qtensor/kernels for what they take (a quantized right operand, a
  bf16 or same-format left one, sm_80+; qtensor/ops/gemm_triton.py, which plans each dense
  product once per layout of its arguments); anything else runs the same reference on the GPU. The
  FP8 block and MXFP4 ops have no GPU kernel: they run their reference there (the FP8 block op
  on the CPU too), as opaque ops so that eager and compiled programs multiply in the same fp32
  matmul (Inductor would otherwise pick its own layouts for the decoded operands, and cuBLAS
  another summation order).
- Meta: the output's shape and dtype (torch.compile traces through it).
- Autograd: the gradient of a high-precision operand and of the bias (the derivative of the
  fp32 epilogue: dY * left * right, times the other operand's exact unit values); quantized
  bytes and amaxes have none.
A compiled graph therefore holds one opaque qtensor op per product on every device. Eager calls
from the GEMM layer that need no autograd, under no mode and outside compilation, call the
device's registered kernel directly (`run_dense`, `run_grouped`): the same function, without
the dispatcher's Python round trips.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from qtensor.backends import has_kernel, has_ops
from qtensor.formats import fp8_block as fp8_block_ref
from qtensor.ops.gemm_operands import (
    B_POSITION,
    MXFP4,
    MXFP8,
    NO_KERNEL,
    NVFP4,
    FP8_ROWS,
    FP8_TILES,
    Side,
    apply_epilogue,
    check_dense,
    check_fp8_block,
    check_grouped,
    dense_shape,
    epilogue_factors,
    pack_args,
    units,
    unpack_args,
)
from qtensor.ops.gemm_triton import device_ok, planned_mm, triton_grouped_mm, triton_problem

SCHEMAS = {
    "nvfp4_mm": "(Tensor a, Tensor? a_scale, Tensor? a_amax, Tensor b, Tensor? b_scale, "
                "Tensor? b_amax, int a_bound, int b_bound, Tensor? bias, ScalarType out_dtype) "
                "-> Tensor",
    "mxfp8_mm": "(Tensor a, Tensor? a_scale, Tensor b, Tensor? b_scale, Tensor? bias, "
                "ScalarType out_dtype) -> Tensor",
    "nvfp4_grouped_mm": "(Tensor a, Tensor? a_scale, Tensor? a_amax, Tensor b, Tensor b_scale, "
                        "Tensor b_amax, Tensor offs, int a_bound, int b_bound, Tensor? bias, "
                        "ScalarType out_dtype) -> Tensor",
    "mxfp8_grouped_mm": "(Tensor a, Tensor? a_scale, Tensor b, Tensor b_scale, Tensor offs, "
                        "Tensor? bias, ScalarType out_dtype) -> Tensor",
    "fp8_block_mm": "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool b_tiles, "
                    "Tensor? bias, ScalarType out_dtype) -> Tensor",
}
SCHEMAS["mxfp4_mm"] = SCHEMAS["mxfp8_mm"]
SCHEMAS["mxfp4_grouped_mm"] = SCHEMAS["mxfp8_grouped_mm"]


# ---- the reference (CPU kernel; also the fallback of the CUDA kernel) --------------------------


def reference_mm(fmt: str, a: Side, b: Side, bias, out_dtype, decode=units) -> torch.Tensor:
    """The exact emulated product: fp32 unit values, torch.matmul, the epilogue. `decode` makes
    the unit values (`units`, or `cpu_units`: the same bits)."""
    acc = torch.matmul(decode(fmt, a), decode(fmt, b).transpose(-1, -2))
    return apply_epilogue(acc, *epilogue_factors(fmt, a, b), bias, out_dtype)


def _row_ends(offs, a: Side) -> list[int]:
    """offs as host ints (a device sync on a GPU: the reference and the CPU op only), checked."""
    ends = offs.tolist()
    if any(e1 < e0 for e0, e1 in zip([0] + ends, ends)) or (ends and ends[-1] > a.data.shape[0]):
        raise ValueError(
            f"offs must be non-decreasing and at most T={a.data.shape[0]}; got {ends}.")
    return ends


def reference_grouped_mm(fmt: str, a: Side, b: Side, offs, bias, out_dtype,
                         decode=units) -> torch.Tensor:
    """Per expert: exact fp32 units, matmul, the dense epilogue on that expert's rows."""
    ends = _row_ends(offs, a)
    ua, ub = decode(fmt, a), decode(fmt, b)
    left, right = epilogue_factors(fmt, a, b)
    out = torch.zeros(a.data.shape[0], b.data.shape[1], dtype=out_dtype, device=ub.device)
    start = 0
    for e, end in enumerate(ends):
        rows = slice(start, end)
        l_e = left[rows] if isinstance(left, torch.Tensor) and left.dim() else left
        r_e = right[e] if isinstance(right, torch.Tensor) and right.dim() else right
        out[rows] = apply_epilogue(ua[rows] @ ub[e].t(), l_e, r_e,
                                   bias[e] if bias is not None else None, out_dtype)
        start = end
    return out


# ---- the CPU kernels: csrc/gemm_cpu.cpp ----------------------------------------------------------

# [Note: CPU GEMM kernel]
# On the CPU the dense ops multiply a quantized weight b [N, K*] (2-D) by an activation of at
# most cpu_fused_max_m() rows (all rows of a 3-D one counted; a float operand, or a quantized
# one's unit values) with qtensor::cpu_weight_mm: the weight is decoded in registers as it
# streams (16 units from a table permute per E2M1 group, the E4M3 bytes by their bits) and
# never written out, and each output sums its K products in fp32 by fused multiply-adds in 16
# lanes, then the lanes by halves. That is the reference's math up to the order of the fp32
# additions: a fused multiply-add rounds once, and a product is exact when it fits fp32 (a bf16,
# fp16 or unit activation times a unit does, unless an MX block's tiny scale takes it below
# fp32's smallest step), so only the sums round. The order depends on K alone, so within the
# row limit an output row's bits do not depend on the other rows, a concatenated weight, the
# threads or the instruction set. The epilogue is the reference's own (`apply_epilogue`).
# Above the limit, and for 3-D weights and the gradients, the operands are decoded once by
# qtensor::cpu_units (the reference's unit values bit for bit, NaN sign and payload aside) for
# torch.matmul: the reference's bits, faster. A grouped product runs each expert's rows through
# this dense product (`cpu_grouped_mm`), so its bits are its experts' dense products'.
# The limit is where decoding once wins (docs/gemm.md has the measurements), per instruction
# set the kernels run (qtensor::cpu_gemm_isa): 2, AVX-512: 256 rows; 1, AVX2 with FMA: 64; 0,
# the baseline, whose fused multiply-add is a library call on a CPU without the instruction: 1.
CPU_FUSED_MAX_M = {0: 1, 1: 64, 2: 256}
_CPU_FORMAT_CODE = {NVFP4: 0, MXFP4: 1, MXFP8: 2}


@functools.cache
def cpu_kernels_built() -> bool:
    """Whether the loaded extension has the CPU GEMM kernels (chosen once)."""
    return has_kernel("cpu_weight_mm", "CPU") and has_kernel("cpu_units", "CPU") and \
        has_ops("cpu_gemm_isa")


@functools.cache
def cpu_fused_max_m() -> int:
    """Activation rows up to which the CPU product decodes the weight in registers, for the
    instruction set this CPU runs (chosen once; 0 without the kernels)."""
    return CPU_FUSED_MAX_M[torch.ops.qtensor.cpu_gemm_isa()] if cpu_kernels_built() else 0


def _cpu_kernel_takes(fmt: str, s: Side) -> bool:
    return s.quantized and fmt in _CPU_FORMAT_CODE and s.data.device.type == "cpu" and \
        cpu_kernels_built()


def cpu_units(fmt: str, side: Side) -> torch.Tensor:
    """`units(fmt, side)` (the same bits), decoded by qtensor::cpu_units for a quantized CPU
    operand of NVFP4, MXFP4 or MXFP8 where the extension has it."""
    if not _cpu_kernel_takes(fmt, side):
        return units(fmt, side)
    data, scale = side.data, side.scale
    lead = data.shape[:-1]
    rows = math.prod(lead)
    out = torch.ops.qtensor.cpu_units(data.reshape(rows, data.shape[-1]),
                                      scale.reshape(rows, scale.shape[-1]), _CPU_FORMAT_CODE[fmt])
    return out.reshape(*lead, out.shape[-1])


def cpu_mm(fmt: str, a: Side, b: Side, bias, out_dtype) -> torch.Tensor:
    """The CPU op's product ([Note: CPU GEMM kernel])."""
    lead = a.data.shape[:-1]
    rows = math.prod(lead)
    if not _cpu_kernel_takes(fmt, b) or b.data.dim() != 2 or rows > cpu_fused_max_m():
        return reference_mm(fmt, a, b, bias, out_dtype, decode=cpu_units)
    x = cpu_units(fmt, a) if a.quantized else a.data
    acc = torch.ops.qtensor.cpu_weight_mm(x.reshape(rows, x.shape[-1]), b.data, b.scale,
                                          _CPU_FORMAT_CODE[fmt])
    acc = acc.reshape(*lead, acc.shape[-1])
    return apply_epilogue(acc, *epilogue_factors(fmt, a, b), bias, out_dtype)


def _expert_rows(s: Side, rows: slice) -> Side:
    amax = s.amax[rows] if s.amax is not None and s.amax.dim() else s.amax
    return Side(s.data[rows], None if s.scale is None else s.scale[rows], amax, s.bound, s.tiles)


def _expert(s: Side, e: int) -> Side:
    amax = s.amax[e] if s.amax is not None and s.amax.dim() else s.amax
    return Side(s.data[e], None if s.scale is None else s.scale[e], amax, s.bound, s.tiles)


def cpu_grouped_mm(fmt: str, a: Side, b: Side, offs, bias, out_dtype) -> torch.Tensor:
    """The CPU grouped op: each expert's rows through the dense CPU op's product (cpu_mm), so a
    grouped product is bitwise its experts' dense products on the CPU (a grouped linear's
    expert is bitwise a linear of its own); rows past offs[-1] are zero."""
    ends = _row_ends(offs, a)
    out = torch.zeros(a.data.shape[0], b.data.shape[1], dtype=out_dtype, device=b.data.device)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            out[rows] = cpu_mm(fmt, _expert_rows(a, rows), _expert(b, e),
                               bias[e] if bias is not None else None, out_dtype)
        start = end
    return out


# ---- the kernels each op registers, per format --------------------------------------------------


def _dense_kernels(fmt: str):
    op = f"{fmt}_mm"

    def checked(args):
        a, b, _, bias, out_dtype = unpack_args(fmt, args, grouped=False)
        check_dense(op, fmt, a, b, bias, out_dtype)
        return a, b, bias, out_dtype

    def cpu(*args):
        return cpu_mm(fmt, *checked(args))

    def cuda(*args):
        if fmt not in NO_KERNEL:
            out = planned_mm(fmt, args, checked)
            if out is not None:
                return out
        return reference_mm(fmt, *checked(args))

    def fake(*args):
        a, b, _, out_dtype = checked(args)
        return a.data.new_empty(dense_shape(a, b), dtype=out_dtype)

    return cpu, cuda, fake


def _grouped_kernels(fmt: str):
    op = f"{fmt}_grouped_mm"

    def checked(args):
        a, b, offs, bias, out_dtype = unpack_args(fmt, args, grouped=True)
        check_grouped(op, fmt, a, b, offs, bias, out_dtype)
        return a, b, offs, bias, out_dtype

    def cpu(*args):
        return cpu_grouped_mm(fmt, *checked(args))

    def cuda(*args):
        a, b, offs, bias, out_dtype = checked(args)
        if fmt not in NO_KERNEL and triton_problem(a, b, None, out_dtype, grouped=True) is None \
                and device_ok(a):
            return triton_grouped_mm(fmt, a, b, offs, bias, out_dtype)
        return reference_grouped_mm(fmt, a, b, offs, bias, out_dtype)

    def fake(*args):
        a, b, _, _, out_dtype = checked(args)
        return a.data.new_empty((a.data.shape[0], b.data.shape[1]), dtype=out_dtype)

    return cpu, cuda, fake


def reference_fp8_block_mm(a, a_scale, b, b_scale, b_tiles, bias, out_dtype) -> torch.Tensor:
    """The exact product of FP8 block operands: fp32 decoded values (exact: E4M3 times a power
    of two), one fp32 matmul, + bias in fp32, the cast."""
    check_fp8_block(a, a_scale, b, b_scale, b_tiles, bias, out_dtype)
    ua = fp8_block_ref.dequantize(a, a_scale, FP8_ROWS)
    ub = fp8_block_ref.dequantize(b, b_scale, FP8_TILES if b_tiles else FP8_ROWS)
    return apply_epilogue(ua @ ub.t(), None, None, bias, out_dtype)


def _fp8_block_fake(a, a_scale, b, b_scale, b_tiles, bias, out_dtype):
    check_fp8_block(a, a_scale, b, b_scale, b_tiles, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# ---- autograd: the high-precision operand and the bias ------------------------------------------


def _setup_context(ctx, inputs, output):
    """Save the tensor inputs for the backward and keep the others (bounds, dtype) on ctx."""
    ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in inputs])
    ctx.plain_inputs = [None if isinstance(t, torch.Tensor) else t for t in inputs]


def _saved_inputs(ctx) -> list:
    return [t if t is not None else p for t, p in zip(ctx.saved_tensors, ctx.plain_inputs)]


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a broadcast batch dim back to `like`'s shape, in like's dtype."""
    if grad.dim() > like.dim():
        grad = grad.sum(0)
    elif grad.shape[0] != like.shape[0]:
        grad = grad.sum(0, keepdim=True)
    return grad.to(like.dtype)


def _dense_backward(fmt: str):
    """The autograd formula of a dense op: d acc = dY * left * right (fp32), then
    dA = d acc @ units(B) and dB = d acc^T @ units(A) for a high-precision side, d bias = sum."""
    pos_b = B_POSITION[fmt]

    def backward(ctx, grad):
        inputs = _saved_inputs(ctx)
        a, b, _, bias, _ = unpack_args(fmt, inputs, grouped=False)
        left, right = epilogue_factors(fmt, a, b)
        d = apply_epilogue(grad.float(), left, right, None, torch.float32)
        grads = [None] * len(inputs)
        if ctx.needs_input_grad[0]:
            grads[0] = _reduce_to(d @ cpu_units(fmt, b), a.data)
        if ctx.needs_input_grad[pos_b]:
            grads[pos_b] = _reduce_to(d.transpose(-1, -2) @ cpu_units(fmt, a), b.data)
        if bias is not None and ctx.needs_input_grad[-2]:
            grads[-2] = _sum_to(grad.float(), bias)
        return tuple(grads)

    return _setup_context, backward


def _sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient of a broadcast add: sum grad down to like's shape."""
    while grad.dim() > like.dim():
        grad = grad.sum(0)
    for i, n in enumerate(like.shape):
        if n == 1 and grad.shape[i] != 1:
            grad = grad.sum(i, keepdim=True)
    return grad.to(like.dtype)


def _grouped_backward(fmt: str):
    """dA rows of expert e = (dY * left * right_e) @ units(B[e]); d bias[e] = sum of its rows.
    Expert e's rows are selected by a mask built from offs on the device (no host sync, so the
    backward traces under torch.compile)."""

    def backward(ctx, grad):
        inputs = _saved_inputs(ctx)
        a, b, offs, bias, _ = unpack_args(fmt, inputs, grouped=True)
        left, right = epilogue_factors(fmt, a, b)
        ub = cpu_units(fmt, b)
        g = grad.float()
        rows = torch.arange(g.shape[0], device=g.device)
        starts = torch.cat([offs.new_zeros(1), offs[:-1]])
        da = torch.zeros(a.data.shape, dtype=torch.float32, device=g.device)
        db = []
        for e in range(ub.shape[0]):
            mine = ((rows >= starts[e]) & (rows < offs[e]))[:, None]
            r_e = right[e] if isinstance(right, torch.Tensor) and right.dim() else right
            d = torch.where(mine, apply_epilogue(g, left, r_e, None, torch.float32), 0.0)
            da = da + d @ ub[e]
            db.append(torch.where(mine, g, 0.0).sum(0))
        grads = [None] * len(inputs)
        if ctx.needs_input_grad[0]:
            grads[0] = da.to(a.data.dtype)
        if bias is not None and ctx.needs_input_grad[-2]:
            grads[-2] = torch.stack(db).to(bias.dtype)
        return tuple(grads)

    return _setup_context, backward


def _fp8_block_backward():
    """Both operands are quantized bytes: only the bias has a gradient."""

    def backward(ctx, grad):
        inputs = _saved_inputs(ctx)
        grads = [None] * len(inputs)
        if inputs[5] is not None and ctx.needs_input_grad[5]:
            grads[5] = _sum_to(grad.float(), inputs[5])
        return tuple(grads)

    return _setup_context, backward


# ---- registration ------------------------------------------------------------------------------

_LIB = torch.library.Library("qtensor", "FRAGMENT")
# Per op: {"cpu": fn, "cuda": fn}, the kernels the dispatcher calls (and the GEMM layer's eager
# direct calls).
KERNELS: dict[str, dict[str, object]] = {}


def _register() -> None:
    # MXFP4's CUDA kernels are its reference until an MXFP4 Triton kernel exists (docs/gemm.md).
    for fmt in (NVFP4, MXFP8, MXFP4):
        _define(f"{fmt}_mm", *_dense_kernels(fmt), *_dense_backward(fmt))
        _define(f"{fmt}_grouped_mm", *_grouped_kernels(fmt), *_grouped_backward(fmt))
    _define("fp8_block_mm", reference_fp8_block_mm, reference_fp8_block_mm, _fp8_block_fake,
            *_fp8_block_backward())


def _define(name, cpu, cuda, fake, setup_context, backward) -> None:
    define(name, SCHEMAS[name], cpu, cuda, fake)
    torch.library.register_autograd(f"qtensor::{name}", backward, setup_context=setup_context,
                                    lib=_LIB)


def define(name: str, schema: str, cpu, cuda, fake) -> None:
    """Register qtensor::<name> with its CPU and CUDA kernels and its fake, for `call`."""
    _LIB.define(name + schema)
    _LIB.impl(name, cpu, "CPU")
    _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"qtensor::{name}", fake, lib=_LIB)
    KERNELS[name] = {"cpu": cpu, "cuda": cuda}


_register()


def _register_cpu_fakes() -> None:
    """Shapes of the CPU GEMM kernels, for the gradients that call cpu_units under
    torch.compile."""
    per_byte = {0: 2, 1: 2, 2: 1}

    @torch.library.register_fake("qtensor::cpu_units")
    def _(data, scale, fmt, isa=-1):
        return data.new_empty((data.shape[0], data.shape[1] * per_byte[fmt]), dtype=torch.float32)

    @torch.library.register_fake("qtensor::cpu_weight_mm")
    def _(x, data, scale, fmt, isa=-1):
        return x.new_empty((x.shape[0], data.shape[0]), dtype=torch.float32)


if cpu_kernels_built():
    _register_cpu_fakes()


def op(name: str):
    return getattr(torch.ops.qtensor, name).default


# ---- calling the ops ---------------------------------------------------------------------------


def _direct_ok(tensors) -> bool:
    """Whether an eager call may skip the dispatcher: not compiling, no dispatch mode or
    functorch transform active, and no autograd to record."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True


def call(name: str, *args) -> torch.Tensor:
    """torch.ops.qtensor.<name>(*args); in plain eager, its device kernel called directly."""
    device = args[0].device.type
    kernels = KERNELS[name]
    if device in kernels and _direct_ok(a for a in args if isinstance(a, torch.Tensor)):
        return kernels[device](*args)
    return op(name)(*args)


def dense_args(fmt: str, a: Side, b: Side, bias, out_dtype) -> tuple:
    return pack_args(fmt, a, b, bias, out_dtype)


def grouped_args(fmt: str, a: Side, b: Side, offs, bias, out_dtype) -> tuple:
    return pack_args(fmt, a, b, bias, out_dtype, offs)
