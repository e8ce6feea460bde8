"""Products of quantized tensors: the exact emulated reference every faster GEMM must match.

[Note: emulated GEMM]
Each operand enters as its exact "unit" values in fp32: NVFP4 `value(q) * s_b` (at most 5
significant bits), MXFP8 `e4m3 * 2**(code - 127)`, MXFP4 `value(q) * 2**(code - 127)`, a
high-precision operand as itself. The fp32
product `acc = units_a @ units_b` is what a bf16-tensor-core kernel with fp32 accumulation
computes, up to accumulation order. The epilogue then applies, in this order, in fp32:
    acc * (A_a * inv)  then  * A_b  then  + bias, then the cast to the output dtype,
where `inv = r(1 / (36 B_a B_b))` when both operands are NVFP4 (`r(1 / (6 B))` with one), A is
each NVFP4 operand's amax (a scalar, or a per-row vector for row-scaled operands: [M, 1] on the
left, [1, N] on the right; 1 for other formats) and B its E4M3 bound.

A left operand must have its blocks along its last dim (rowwise), a right operand along dim -2
(columnwise); a HybridTensor hands over the matching side. Both quantized operands must share
one format and, for NVFP4, the same RHT flag.

[Note: GEMM backends]
Each quantized tensor carries `gemm_backend` (qtensor.backends.GemmBackend), resolved once when
it is made or moved; a product runs on its right operand's (the weight's) backend, or the left
operand's when the right one is high precision:
- `emulated`: this module's reference, any device. On the CPU the op that runs it takes the
  C++ kernels where the extension is built ([Note: CPU GEMM kernel] in qtensor/ops/gemm_ops.py:
  the same unit values, summed in their own fp32 order up to a row limit per instruction set).
- `triton` (qtensor/kernels): bf16 tensor cores, fp32 accumulation, this epilogue fused; equal
  to the reference up to fp32 accumulation order. Up to 64 rows the weight is decoded in
  registers as it streams (split-K); above, each operand is decoded to exact bf16 once and the
  bf16 kernel runs (docs/gemm.md has the measurements behind the split). It covers NVFP4 x
  NVFP4, MXFP8 x MXFP8 and a bf16 left operand x NVFP4 / MXFP8, 2-D, 3-D and grouped.
- `scaled_mm` (qtensor/gemm/scaled_mm.py): native block-scaled torch._scaled_mm, sm_100+ only,
  fp32 output, then this epilogue. Untested on hardware (docs/gemm.md).
FP8 block operands (FP8BlockTensor, 1x128 blocks or 128x128 tiles) have no Triton kernel: their
products run qtensor::fp8_block_mm (its exact reference, inside the opaque op on every device)
unless the tensors ask for `scaled_mm`, then torch._scaled_mm with fp32 block scales on sm_90+
(opt-in: docs/qat.md, "Status"). MXFP4 operands (MXFP4Tensor) have no GPU kernel either: their
products, dense and grouped, run qtensor::mxfp4_mm / mxfp4_grouped_mm (the exact reference on
the GPU, the CPU kernels on the CPU) whatever backend the tensors name (docs/gemm.md).
A product a backend has no kernel for (a quantized left operand times a high-precision right
one, an fp32 / fp16 activation, more than 3 dims, a CPU operand) runs on the reference: the
same numbers, never a different precision. `gemm_plan(a, b)` says which path a product takes.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from qtensor.backends import GEMM_BACKENDS, GemmBackend, ScaledMMFormat, gemm_backend_problem
from qtensor.ops import gemm_ops, gemm_triton
from qtensor.ops.gemm_operands import FP8_BLOCK, MXFP4, NO_KERNEL, Side, fresh_reshape
from qtensor.gemm.scaled_mm import fp8_block_scaled_mm, scaled_mm_args, scaled_mm_problem
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import COLUMNWISE, ROWWISE
from qtensor.tensors.decode import DecodeWeight
from qtensor.tensors.hybrid import HybridTensor, quantize_spec
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor
from qtensor.tensors.layout import map_parts

aten = torch.ops.aten
apply_epilogue = gemm_ops.apply_epilogue


# ---- operands ---------------------------------------------------------------------------------


def _side(x, side: str):
    """The operand a GEMM multiplies on this side (the class's `gemm_operand`: a composite's
    matching part, else x itself when its blocks run along the reduction dim)."""
    return x.gemm_operand(side) if isinstance(x, QuantizedTensor) else x


def _check_pair(a, b) -> None:
    qa, qb = isinstance(a, QuantizedTensor), isinstance(b, QuantizedTensor)
    if qa and qb:
        if type(a) is not type(b):
            raise TypeError(
                f"A GEMM needs both operands in one format; got {type(a).__name__} x "
                f"{type(b).__name__}. Use a HybridTensor to carry both formats."
            )
        problem = a.pair_problem(b)
    else:
        problem = a.pair_problem(None) if qa else b.pair_problem(None) if qb else None
    if problem:
        raise ValueError(f"{problem}.")


def operands(a, b):
    """(left, right) operands of a @ b, checked: hybrids give their matching side."""
    a_op, b_op = _side(a, "left"), _side(b, "right")
    _check_pair(a_op, b_op)
    return a_op, b_op


def _format(a_op, b_op) -> str:
    """The GEMM ops' format of a product (the quantized operand's class declares it)."""
    return (a_op if isinstance(a_op, QuantizedTensor) else b_op).gemm_format


def _rows_side(x, rows_are_logical_rows: bool) -> Side:
    """x as the ops' rows along K: a left operand's rows are its logical rows (rowwise storage),
    a right operand's rows are its logical columns (columnwise storage, or a high-precision
    tensor's transpose view). A quantized operand's class says how (`gemm_rows`)."""
    if isinstance(x, QuantizedTensor):
        return Side(*x.gemm_rows(rows_are_logical_rows))
    return Side(x if rows_are_logical_rows else x.transpose(-1, -2))


def _flatten_batch(s: Side, lead) -> Side:
    """Fold several leading dims into one (2-D stays 2-D)."""
    if len(lead) <= 1:
        return s

    def fold(t):
        return t if t is None or t.dim() == 0 else t.reshape(-1, *t.shape[len(lead):])

    return Side(fold(s.data), fold(s.scale), fold(s.amax), s.bound, s.tiles)


def dense_sides(a_op, b_op) -> tuple[str, Side, Side, tuple]:
    """(format, a, b, leading dims of the output) of a_op [.., M, K] @ b_op [.., K, N] as the
    ops take them: rows along K, at most one batch dim."""
    lead_a, lead_b = tuple(a_op.shape[:-2]), tuple(b_op.shape[:-2])
    if lead_a and lead_b and lead_a != lead_b:
        raise ValueError(
            f"A quantized GEMM needs equal batch dims (a quantized operand is never broadcast); "
            f"got {tuple(a_op.shape)} x {tuple(b_op.shape)}. Expand the high-precision operand "
            "first."
        )
    lead = lead_a or lead_b
    a = _flatten_batch(_rows_side(a_op, True), lead_a)
    b = _flatten_batch(_rows_side(b_op, False), lead_b)
    return _format(a_op, b_op), a, b, lead


def epilogue_factors(a, b):
    """(left, right) fp32 multipliers of the epilogue: left = A_a * inv (or inv), right = A_b.

    None where a side has no factor (MXFP8 and high-precision operands). Every backend applies
    exactly these values, so the factors are bit-identical across backends.
    """
    fmt, sa, sb, _ = dense_sides(a, b)
    return gemm_ops.epilogue_factors(fmt, sa, sb)


# ---- backends ---------------------------------------------------------------------------------


def _run_dense(fmt, a: Side, b: Side, bias, out_dtype, lead, backend: GemmBackend):
    """The product on `backend`: the qtensor op on the CPU and for the triton backend (its CUDA
    kernel runs Triton), the reference itself for the emulated backend on other devices."""
    args = gemm_ops.dense_args(fmt, a, b, bias, out_dtype)
    # The FP8 block and MXFP4 ops have no Triton kernel: their exact reference runs inside the
    # opaque op on every device, so eager and compiled programs multiply in the same fp32 matmul.
    if fmt in NO_KERNEL or backend is GemmBackend.TRITON or \
            a.data.device.type in ("cpu", "meta"):
        out = gemm_ops.call(f"{fmt}_mm", *args)
    else:
        out = gemm_ops.reference_mm(fmt, a, b, bias, out_dtype)
    if len(lead) > 1:
        out = fresh_reshape(out, (*lead, *out.shape[-2:]))
    return out


def emulated_mm(a_op, b_op, bias, out_dtype) -> torch.Tensor:
    """The reference: exact fp32 unit values, torch.matmul, the epilogue (any device)."""
    fmt, a, b, lead = dense_sides(a_op, b_op)
    out = gemm_ops.reference_mm(fmt, a, b, bias, out_dtype)
    return fresh_reshape(out, (*lead, *out.shape[-2:])) if len(lead) > 1 else out


def triton_mm(a_op, b_op, bias, out_dtype, config=None, predecode=None) -> torch.Tensor:
    """The Triton kernels on these operands, with an optional tile config and decode choice
    (benchmarks and tests; products reach them through the ops)."""
    fmt, a, b, lead = dense_sides(a_op, b_op)
    problem = gemm_triton.triton_problem(a, b, bias, out_dtype)
    if problem:
        raise ValueError(f"The Triton GEMM cannot run this product: {problem}.")
    return gemm_triton.triton_mm(fmt, a, b, bias, out_dtype, config, predecode)


def native_scaled_mm(a_op, b_op, bias, out_dtype) -> torch.Tensor:
    """torch._scaled_mm with swizzled block scales (FP8 block operands: fp32 block scales),
    fp32 out, then the shared epilogue."""
    if b_op.gemm_format == FP8_BLOCK:
        return fp8_block_scaled_mm(a_op, b_op, bias, out_dtype)
    args = scaled_mm_args(a_op, b_op)
    acc = torch._scaled_mm(
        args.mat_a, args.mat_b, args.scale_a, args.scale_b, out_dtype=torch.float32
    )
    return apply_epilogue(acc, *epilogue_factors(a_op, b_op), bias, out_dtype)


def product_backend(a_op, b_op) -> GemmBackend:
    """The backend the tensors ask for: the right operand's, or the left's if b is high
    precision."""
    owner = b_op if isinstance(b_op, QuantizedTensor) else a_op
    return GEMM_BACKENDS[getattr(owner, "gemm_backend", GemmBackend.EMULATED.value)]


def plan(a_op, b_op, bias, out_dtype, sides=None, *, grouped: bool = False) -> GemmBackend:
    """The backend that runs this product, dense or grouped (the one planner of the layer): the
    requested one if it has a kernel for it, else the next one down (scaled_mm -> triton ->
    emulated; no native grouped call is wired, so a grouped product asking for scaled_mm runs
    on triton). `sides`: the operands as the ops take them when the caller has them already
    (dense_sides(a_op, b_op); the grouped layer's own for a grouped product, which must pass
    them)."""
    backend = product_backend(a_op, b_op)
    if _format(a_op, b_op) == MXFP4:  # no GPU kernel of any backend yet: the op's own
        return GemmBackend.EMULATED
    if _format(a_op, b_op) == FP8_BLOCK:  # no Triton kernel: native, or the op's reference
        if backend is GemmBackend.SCALED_MM and not grouped and \
                scaled_mm_problem(a_op, b_op, bias) is None:
            return backend
        return GemmBackend.EMULATED
    if backend is GemmBackend.SCALED_MM:
        if not grouped and scaled_mm_problem(a_op, b_op, bias) is None:
            return backend
        if not grouped and gemm_backend_problem(GemmBackend.TRITON, b_op.device) is not None:
            return GemmBackend.EMULATED
        backend = GemmBackend.TRITON
    if backend is GemmBackend.TRITON:
        _, a, b, *_ = sides or dense_sides(a_op, b_op)
        if gemm_triton.triton_problem(a, b, None if grouped else bias, out_dtype,
                                   grouped=grouped) is None:
            return backend
    return GemmBackend.EMULATED


def gemm_plan(a, b, bias=None, out_dtype=None) -> GemmBackend:
    """Which backend `quantized_mm(a, b, bias, out_dtype)` would run on."""
    a_op, b_op = operands(a, b)
    return plan(a_op, b_op, bias, out_dtype or a.dtype)


def quantized_mm(a, b, bias=None, out_dtype=None) -> torch.Tensor:
    """a [.., M, K] @ b [.., K, N] (+ bias [N]) where either operand may be quantized."""
    a_op, b_op = operands(a, b)
    out_dtype = out_dtype or a.dtype
    sides = dense_sides(a_op, b_op)
    backend = plan(a_op, b_op, bias, out_dtype, sides)
    if backend is GemmBackend.SCALED_MM:
        return native_scaled_mm(a_op, b_op, bias, out_dtype)
    return _run_dense(*sides[:3], bias, out_dtype, sides[3], backend)


# The classes whose GEMM rows do not change under a transpose: x.t()'s rows with one flag are x's
# rows with the other (NVFP4's storage is the same bytes either way; MXFP8's transpose is a view
# of both tensors, which gemm_rows undoes).
_FLIP_SAFE = (NVFP4Tensor, MXFP8Tensor)


def _transposed_part(x, side: str):
    """The part of x that multiplies on `side` of a product taking x.t(), or None where the
    transposed view must be built (another class, more than 2 dims, a wrong axis: the regular
    path then raises its own error)."""
    if x.dim() != 2:
        return None
    if isinstance(x, HybridTensor):  # x.t()'s rowwise side is x's columnwise side, and back
        part = x.columnwise if side == "left" else x.rowwise
        return part if part is not None and type(part) in _FLIP_SAFE else None
    if type(x) is torch.Tensor:
        return x
    want = COLUMNWISE if side == "left" else ROWWISE  # the axis x.t() flips to `side`'s
    return x if type(x) in _FLIP_SAFE and x.axis == want else None


def quantized_mm_t(a, b, bias=None, out_dtype=None, *, a_t: bool = False, b_t: bool = False):
    """quantized_mm(a.t() if a_t else a, b.t() if b_t else b, bias, out_dtype) for 2-D operands,
    without building the transposed views.

    The training products (fprop x @ w.t(), wgrad dy.t() @ x) take a transposed operand; on a
    small layer the view's wrappers (a HybridTensor and its two parts) cost more host time than
    launching the product. Here the part that multiplies is picked from the untransposed tensor
    and its rows taken with the other flag: the same sides, planner and op as quantized_mm, so
    the same bits. Anything else (other classes, batched operands, the native scaled_mm
    backend, which takes the logical operands) goes through quantized_mm itself."""
    a_op = _transposed_part(a, "left") if a_t else _side(a, "left")
    b_op = _transposed_part(b, "right") if b_t else _side(b, "right")
    if a_op is not None and b_op is not None and a_op.dim() == b_op.dim() == 2:
        _check_pair(a_op, b_op)
        out_dtype = out_dtype or a.dtype
        fmt = _format(a_op, b_op)
        sides = (fmt, _rows_side(a_op, not a_t), _rows_side(b_op, b_t), ())
        backend = plan(a_op, b_op, bias, out_dtype, sides)
        if backend is not GemmBackend.SCALED_MM:
            return _run_dense(*sides[:3], bias, out_dtype, (), backend)
    return quantized_mm(a.t() if a_t else a, b.t() if b_t else b, bias, out_dtype)


def with_gemm_backend(x: QuantizedTensor, backend: GemmBackend | str) -> QuantizedTensor:
    """x with its products forced onto `backend` (the explicit override); raises if that backend
    cannot run on x's device."""
    backend = GemmBackend(backend)

    def force(part: QuantizedTensor) -> QuantizedTensor:
        fmt = part.gemm_format
        scaled = ScaledMMFormat.FP8_BLOCK128 if fmt == FP8_BLOCK else ScaledMMFormat.MX_BLOCK
        problem = gemm_backend_problem(backend, part.device, scaled)
        if problem is None and backend is GemmBackend.TRITON and fmt in NO_KERNEL:
            problem = (f"there is no Triton kernel for {fmt} operands yet (their products run "
                       "the exact reference op); leave gemm_backend as it is")
        if problem is None and backend is GemmBackend.SCALED_MM and fmt == MXFP4:
            problem = "no native MXFP4 GEMM is wired (its products run the exact reference op)"
        if problem:
            raise ValueError(f"Cannot set gemm_backend={backend.value!r} on {part!r}: {problem}.")
        return part.replace(gemm_backend=backend.value)

    return map_parts(x, force)


# ---- op table ---------------------------------------------------------------------------------


def _refuse_skipped_activation_quant(a, b) -> None:
    """A weight with an act_spec multiplies a quantized activation; only F.linear quantizes it."""
    if getattr(b, "act_spec", None) is not None and not isinstance(a, QuantizedTensor):
        raise ValueError(
            "This weight quantizes its activation inside F.linear (act_spec="
            f"{b.act_spec}); a plain mm/addmm/matmul would silently run weight-only math. Call "
            "F.linear, or quantize the activation first (qtensor.tensors.quantize_spec)."
        )


@QuantizedTensor.implements([aten.mm.default, aten.bmm.default, aten.matmul.default])
def _mm(func, args, kwargs):
    _refuse_skipped_activation_quant(args[0], args[1])
    return quantized_mm(args[0], args[1])


@QuantizedTensor.implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args[:3]
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise ValueError("Quantized addmm supports beta=1 and alpha=1 only.")
    _refuse_skipped_activation_quant(a, b)
    return quantized_mm(a, b, bias)


@QuantizedTensor.implements(aten.linear.default)
def _linear_dispatch(func, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return linear(x, w, bias)


def linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """F.linear with a quantized weight. A weight with an act_spec quantizes x first; when
    autograd needs x's or the bias's gradient it is straight-through the activation quantizer
    (`DynamicActivationLinear`). The output is a tensor of its own, as nn.Linear's is."""
    if isinstance(weight, DecodeWeight):
        return _decode_linear(x, weight, bias)
    out = _prepared_linear(x, weight, bias)
    if out is not None:
        return out
    spec = getattr(weight, "act_spec", None)
    if spec is not None and not isinstance(x, QuantizedTensor) and x.numel():
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return DynamicActivationLinear.apply(x, bias, _Frozen(weight), spec)
        # Activations are not checked for NaN/Inf: the check would cost a device sync per
        # layer; a non-finite activation poisons its amax and decodes to NaN instead.
        x = quantize_spec(x, spec, check_finite=False)
    return _linear_quantized(x, weight, bias)


def _decode_linear(x, weight: DecodeWeight, bias) -> torch.Tensor:
    """F.linear with a weight in the decode layout: qtensor::decode_mm on the packed bytes
    ([Note: decode weights] in qtensor/tensors/decode.py)."""
    from qtensor.ops.decode_mm import decode_mm

    if isinstance(x, QuantizedTensor) or not x.is_floating_point():
        raise TypeError(f"a weight in the decode layout multiplies a high-precision float "
                        f"activation; got {type(x).__name__} {x.dtype}. Use weight.canonical() "
                        "for quantized activations.")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"F.linear: the activation's last dim is {x.shape[-1]}, the weight "
                         f"{tuple(weight.shape)} takes K = {k}.")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)
    out = decode_mm(x2, weight.codes, weight.scales, weight.amax, bias, weight.fmt, n, k,
                    weight.bound, x.dtype)
    return fresh_reshape(out, (*lead, n)) if x.dim() != 2 else out


def _linear_quantized(x, weight, bias) -> torch.Tensor:
    """F.linear of x (high precision, or already quantized) and a quantized weight. An empty x
    multiplies as it is: the op returns the empty product, as nn.Linear does."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k) if x.dim() != 2 else x
    out = _linear_2d(x2, weight, bias, x.dtype)
    if out is None:
        out = quantized_mm(x2, weight.t(), bias, out_dtype=x.dtype)
    return fresh_reshape(out, (*lead, out.shape[-1])) if x.dim() != 2 else out


class _Frozen:
    """Holds the quantized weight so autograd's apply() does not treat it as an input."""

    def __init__(self, weight):
        self.weight = weight


class DynamicActivationLinear(torch.autograd.Function):
    """F.linear whose activation is quantized on the fly (a dynamic-activation config).

    Forward: the quantized product, bit for bit the inference path. Backward: straight through
    the activation quantizer, as QAT and adapter training expect: dX = dY @ W with W the
    weight's exact decoded values (fp32 products, cast to x's dtype), d bias = the sum of dY.
    The quantized weight is frozen (it has no gradient).
    """

    @staticmethod
    def forward(ctx, x, bias, frozen: _Frozen, spec):
        ctx.frozen, ctx.x_dtype = frozen, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        xq = quantize_spec(x, spec, check_finite=False)
        return _linear_quantized(xq, frozen.weight, bias)

    @staticmethod
    def backward(ctx, dy):
        dx = db = None
        n = dy.shape[-1]
        if ctx.needs_input_grad[0]:
            w = ctx.frozen.weight.dequantize(torch.float32)  # [N, K]
            dx = (dy.float().reshape(-1, n) @ w).reshape(*dy.shape[:-1], -1).to(ctx.x_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[1]:
            db = dy.float().reshape(-1, n).sum(0).to(ctx.bias_dtype)
        return dx, db, None, None


def _linear_2d(x2, weight, bias, out_dtype) -> torch.Tensor | None:
    """F.linear's direct path: a rowwise 2-D weight [N, K] already is the right operand as rows
    along K, so the op takes its bytes without building the transposed tensor (a subclass
    dispatch per call). None for other weights (hybrids, columnwise, scaled_mm)."""
    fmt = type(weight).gemm_format
    if fmt is None or weight.axis != ROWWISE or weight.dim() != 2:
        return None
    backend = weight.gemm_backend
    if backend == "scaled_mm":
        return None
    a_op = _side(x2, "left")
    _check_pair(a_op, weight)
    a = _rows_side(a_op, True)
    b = _rows_side(weight, True)  # the weight's rows are N: rows along K as it is stored
    # For the triton backend the op's CUDA kernel itself runs the reference for what the
    # kernels do not take, so nothing is checked twice here.
    return _run_dense(fmt, a, b, bias, out_dtype, (), GEMM_BACKENDS[backend])


# ---- the eager decode path: one prepared product per weight and activation layout ----------

# [Note: prepared linear]
# An eager weight-only F.linear at decode shapes (M <= 64 rows, a contiguous bf16 activation,
# a rowwise 2-D NVFP4 / MXFP8 weight on the triton backend) spends more time in Python than in
# its kernels: building the operands, the op's checks, the launch arguments. All of that depends
# only on the weight, the bias and the activation's layout, so it is done once, into a
# `qgemm.Prepared` kept per weight (`_PLANS`, keyed by the weight's id and dropped with it) and
# per (activation shape, strides, dtype, device, 16-byte alignment, bias); a call then checks
# that nothing else is asked of it and launches the same kernels with the same arguments as the
# op would, so the bits are the op's. It applies only where the op itself would be called
# directly: not compiling, no dispatch mode or functorch transform, no autograd to record.
# A weight whose inner tensors are replaced (never done by qtensor itself) gets new plans.
_PLANS: dict[int, tuple] = {}
_PLANS_PER_WEIGHT = 16


def _inner(weight) -> list:
    return [getattr(weight, n) for n in type(weight).tensor_data_names]


def _prepared_linear(x, weight, bias):
    """F.linear through the weight's prepared product, or None where it does not apply."""
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return None
    if getattr(weight, "gemm_backend", None) != "triton":
        return None
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if is_in_torch_dispatch_mode() or torch._C._are_functorch_transforms_active():
        return None
    entry = _PLANS.get(id(weight))
    if entry is None or entry[0]() is not weight:
        if getattr(type(weight), "gemm_format", None) is None:
            return None
        entry = (weakref.ref(weight, lambda _, i=id(weight): _PLANS.pop(i, None)), {})
        _PLANS[id(weight)] = entry
    plans = entry[1]
    key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, id(bias))
    found = plans.get(key)
    if found is None:
        if len(plans) >= _PLANS_PER_WEIGHT:
            plans.clear()
        # The bias rides along so that its id in the key cannot be reused while the plan lives.
        found = plans[key] = (_prepare_linear(x, weight, bias), _inner(weight), bias)
    prepared, inner, _ = found
    if prepared is None:
        return None
    now = _inner(weight)
    if now[0] is not inner[0] or now[1] is not inner[1] or now[-1] is not inner[-1]:
        plans.pop(key, None)
        return _prepared_linear(x, weight, bias)
    return prepared(x)


def _prepare_linear(x, weight, bias):
    """The Prepared product of F.linear(x-like, weight, bias), or None (the general path)."""
    if getattr(weight, "act_spec", None) is not None:
        return None
    if weight.axis != ROWWISE or weight.qdata.dim() != 2 or x.dim() < 2 or not x.is_contiguous():
        return None
    if x.dtype != torch.bfloat16 or getattr(weight, "rht", False):
        return None
    fmt = type(weight).gemm_format
    n = weight.qdata.shape[0]
    x2 = x.view(-1, x.shape[-1])
    return gemm_triton.prepare_dense(fmt, Side(x2), _rows_side(weight, True), bias, x.dtype,
                                  (*x.shape[:-1], n))


QuantizedTensor._function_table[torch.nn.functional.linear] = linear


# mm, bmm, matmul (and @) and addmm are handled at the torch level too, before autograd, as
# F.linear is: the GEMM op's autograd then gives a high-precision operand its gradient. Below
# autograd, aten's formulas would multiply the gradient by the quantized operand's transpose,
# which has its blocks along the wrong dim. Other forms (1-D operands, out=) take the aten path.
def _torch_level(func, handler):
    def run(*args, **kwargs):
        out = handler(*args, **kwargs) if "out" not in kwargs else None
        if out is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return out

    return run


def _product(a, b):
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or \
            b.dim() < 2:
        return None
    _refuse_skipped_activation_quant(a, b)
    return quantized_mm(a, b)


def _product_plus(bias, a, b, *, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise ValueError("Quantized addmm supports beta=1 and alpha=1 only.")
    if a.dim() != 2 or b.dim() != 2:
        return None
    _refuse_skipped_activation_quant(a, b)
    return quantized_mm(a, b, bias)


for _f in (torch.mm, torch.bmm, torch.matmul, torch.Tensor.mm, torch.Tensor.bmm,
           torch.Tensor.matmul, torch.Tensor.__matmul__):
    QuantizedTensor._function_table[_f] = _torch_level(_f, _product)
for _f in (torch.addmm, torch.Tensor.addmm):
    QuantizedTensor._function_table[_f] = _torch_level(_f, _product_plus)
