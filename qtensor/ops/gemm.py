"""Products of quantized tensors: the exact emulated reference every faster GEMM must match.

[Note: emulated GEMM]
Each operand enters as its exact "unit" values in fp32: NVFP4 `value(q) * s_b` (at most 5
significant bits), MXFP8 `e4m3 * 2**(code - 127)`, a high-precision operand as itself. The fp32
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
- `emulated`: this module's reference, any device.
- `triton` (qtensor/kernels): bf16 tensor cores, fp32 accumulation, this epilogue fused; equal
  to the reference up to fp32 accumulation order. Up to 64 rows the weight is decoded in
  registers as it streams (split-K); above, each operand is decoded to exact bf16 once and the
  bf16 kernel runs (docs/gemm.md has the measurements behind the split). It covers NVFP4 x
  NVFP4, MXFP8 x MXFP8 and a bf16 left operand x NVFP4 / MXFP8, 2-D, 3-D and grouped.
- `scaled_mm` (qtensor/ops/scaled_mm.py): native block-scaled torch._scaled_mm, sm_100+ only,
  fp32 output, then this epilogue. Untested on hardware (docs/gemm.md).
A product a backend has no kernel for (a quantized left operand times a high-precision right
one, an fp32 / fp16 activation, more than 3 dims, a CPU operand) runs on the reference: the
same numbers, never a different precision. `gemm_plan(a, b)` says which path a product takes.
"""
from __future__ import annotations


import torch

from qtensor.backends import GemmBackend, gemm_backend_problem
from qtensor.formats.elements import fdiv
from qtensor.ops.scaled_mm import scaled_mm_args, scaled_mm_problem
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import COLUMNWISE, FLOAT_DTYPES, ROWWISE
from qtensor.tensors.hybrid import HybridTensor, quantize_spec
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor

aten = torch.ops.aten
_WANT = {"left": ROWWISE, "right": COLUMNWISE}


# r(1 / denom) in fp32 for every epilogue denominator (36 B_a B_b, or 6 B with one NVFP4 operand,
# B in {448, 256}), computed once at import as Python floats holding exact fp32 values: no
# product builds a device tensor for them, and torch.compile sees constants. A fp32 tensor times
# such a float rounds once, exactly as a tensor-tensor multiply does.
_BOUNDS = (448, 256)
_INV = {
    d: fdiv(1.0, torch.tensor(d)).item()
    for d in {6.0 * a * 6.0 * b for a in _BOUNDS for b in _BOUNDS} | {6.0 * b for b in _BOUNDS}
}


# ---- operands ---------------------------------------------------------------------------------


def _side(x, side: str):
    """The operand a GEMM multiplies on this side: a hybrid's matching half, else x itself."""
    if isinstance(x, HybridTensor):
        return x.rowwise if side == "left" else x.columnwise
    if isinstance(x, QuantizedTensor) and x.axis != _WANT[side]:
        raise ValueError(
            f"The {side} operand of a quantized GEMM needs its blocks along the reduction dim "
            f"({_WANT[side]}); got {x!r}. Quantize it with columnwise="
            f"{side == 'right'} or pass its transpose."
        )
    return x


def _check_pair(a, b) -> None:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        if type(a) is not type(b):
            raise TypeError(
                f"A GEMM needs both operands in one format; got {type(a).__name__} x "
                f"{type(b).__name__}. Use a HybridTensor to carry both formats."
            )
        if isinstance(a, NVFP4Tensor) and a.rht != b.rht:
            raise ValueError(
                "NVFP4 RHT must be applied to both GEMM operands or neither (it cancels only "
                f"in pairs); got rht={a.rht} x rht={b.rht}."
            )
    elif getattr(a, "rht", False) or getattr(b, "rht", False):
        raise ValueError("An RHT-transformed NVFP4 operand needs an RHT-transformed partner.")


def operands(a, b):
    """(left, right) operands of a @ b, checked: hybrids give their matching side."""
    a_op, b_op = _side(a, "left"), _side(b, "right")
    _check_pair(a_op, b_op)
    return a_op, b_op


def _units(x) -> torch.Tensor:
    return x.unit_values() if isinstance(x, QuantizedTensor) else x.float()


# ---- the epilogue, shared by every backend ---------------------------------------------------


def _epilogue_terms(a, b):
    """(A_a or None, inv or None, A_b or None): each NVFP4 operand's amax (shaped for the output)
    and inv = r(1 / (36 B_a B_b)), or r(1 / (6 B)) with one NVFP4 operand; all None otherwise."""
    nv_a, nv_b = isinstance(a, NVFP4Tensor), isinstance(b, NVFP4Tensor)
    if not (nv_a or nv_b):
        return None, None, None
    denom = (6.0 * a.e4m3_bound if nv_a else 1.0) * (6.0 * b.e4m3_bound if nv_b else 1.0)
    return (a.amax_for("left") if nv_a else None, _INV[denom],
            b.amax_for("right") if nv_b else None)


def epilogue_factors(a, b):
    """(left, right) fp32 multipliers of the epilogue: left = A_a * inv (or inv), right = A_b.

    None where a side has no factor (MXFP8 and high-precision operands). Every backend applies
    exactly these values, so the factors are bit-identical across backends.
    """
    amax_a, inv, amax_b = _epilogue_terms(a, b)
    if inv is None:
        return None, None
    return (amax_a * inv if amax_a is not None else inv), amax_b


def apply_epilogue(acc, left, right, bias, out_dtype) -> torch.Tensor:
    """acc * left, then * right, then + bias, then the cast: [Note: emulated GEMM]'s order."""
    if left is not None:
        acc = acc * left
    if right is not None:
        acc = acc * right
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


# ---- backends ---------------------------------------------------------------------------------


def emulated_mm(a_op, b_op, bias, out_dtype) -> torch.Tensor:
    """The reference: exact fp32 unit values, torch.matmul, the epilogue."""
    acc = torch.matmul(_units(a_op), _units(b_op))
    return apply_epilogue(acc, *epilogue_factors(a_op, b_op), bias, out_dtype)


def triton_problem(a_op, b_op, bias, out_dtype) -> str | None:
    """Why the Triton kernels cannot run this product, or None."""
    if not isinstance(b_op, (NVFP4Tensor, MXFP8Tensor)):
        return "the right operand is not NVFP4 or MXFP8"
    if not isinstance(a_op, QuantizedTensor) and a_op.dtype != torch.bfloat16:
        return f"a high-precision left operand must be bfloat16 to be exact; got {a_op.dtype}"
    if a_op.device.type != "cuda" or b_op.device.type != "cuda":
        return "an operand is not on a CUDA device"
    if a_op.dim() not in (2, 3) or b_op.dim() not in (2, 3):
        return f"the kernels take 2-D or 3-D operands; got {a_op.dim()}-D x {b_op.dim()}-D"
    if a_op.dim() == b_op.dim() == 3 and 1 < a_op.shape[0] != b_op.shape[0] > 1:
        return "batch sizes differ"
    if out_dtype not in FLOAT_DTYPES or (bias is not None and bias.dim() != 1):
        return "the output dtype or the bias shape is not one the kernels write"
    if a_op.numel() == 0 or b_op.numel() == 0:
        return "an operand is empty"
    return None


def _kernel_operand(x, side: str, kernels):
    """A kernel Operand: the operand's bytes as rows along K, with a leading batch dim."""

    def batched(t):
        return t if t.dim() == 3 else t.unsqueeze(0)

    if not isinstance(x, QuantizedTensor):
        return kernels.Operand(kernels.FMT_HP, batched(x), None)
    if isinstance(x, NVFP4Tensor):  # rowwise storage, or columnwise storage [.., N, K/2]
        return kernels.Operand(kernels.FMT_NVFP4, batched(x.qdata), batched(x.scale))
    q, s = x.qdata, x.scale
    if side == "right":  # MXFP8 columnwise data is [.., K, N]: its transpose view is rows along K
        q, s = q.transpose(-1, -2), s.transpose(-1, -2)
    return kernels.Operand(kernels.FMT_MXFP8, batched(q), batched(s.view(torch.uint8)))


def kernel_epilogue(a, b, bias, kernels):
    """epilogue_factors' terms for a kernel, which forms amax_a * inv itself (in fp32)."""
    return kernels.Epilogue(*_epilogue_terms(a, b), bias)


def triton_mm(a_op, b_op, bias, out_dtype, config=None, predecode=None) -> torch.Tensor:
    """The triton backend. Above qgemm.DECODE_FIRST_M rows (or with predecode=True) each
    quantized operand is decoded to exact bf16 once, then multiplied by the bf16 kernel."""
    from qtensor.kernels import qgemm

    # The right operand as rows along K: for a transposed rowwise weight, its own bytes.
    b = _kernel_operand(b_op, "right", qgemm)
    out = _run_qgemm(a_op, b_op, b, b_op.shape[-1], bias, out_dtype, config, predecode)
    return out[0] if a_op.dim() == 2 and b_op.dim() == 2 else out


def _run_qgemm(a_op, b_amax_op, b, n, bias, out_dtype, config=None, predecode=None):
    from qtensor.kernels import qgemm

    m, k = a_op.shape[-2], a_op.shape[-1]
    a = _kernel_operand(a_op, "left", qgemm)
    if predecode if predecode is not None else m > qgemm.DECODE_FIRST_M:
        a, b = qgemm.decode_bf16(a, m, k), qgemm.decode_bf16(b, n, k)
    elif predecode is None:
        # Small M: the weight streams and is decoded in registers; the few activation rows are
        # decoded once up front rather than once per N tile (8192 / 64 = 128 times).
        a = qgemm.decode_bf16(a, m, k)
    ep = kernel_epilogue(a_op, b_amax_op, bias, qgemm)
    return qgemm.qgemm(a, b, ep, out_dtype=out_dtype, m=m, n=n, k=k, config=config)


def _triton_linear(x2, weight, bias, out_dtype) -> torch.Tensor | None:
    """F.linear's fast path: a rowwise 2-D weight is already rows along K, so the kernel reads
    it without building the transposed tensor (which costs a subclass dispatch per call).
    None when the product is not one for the triton backend."""
    if (
        type(weight) not in (NVFP4Tensor, MXFP8Tensor)
        or weight.gemm_backend != GemmBackend.TRITON.value
        or weight.axis != ROWWISE
        or weight.dim() != 2
        or triton_problem(x2, weight, bias, out_dtype) is not None
    ):
        return None
    _check_pair(_side(x2, "left"), weight)
    from qtensor.kernels import qgemm

    # amax_for("right") of a rowwise weight is its per-row amax as [1, N]: what the
    # transposed (columnwise) view would give.
    b = _kernel_operand(weight, "left", qgemm)
    return _run_qgemm(x2, weight, b, weight.shape[0], bias, out_dtype)[0]


def native_scaled_mm(a_op, b_op, bias, out_dtype) -> torch.Tensor:
    """torch._scaled_mm with swizzled block scales, fp32 out, then the shared epilogue."""
    args = scaled_mm_args(a_op, b_op)
    acc = torch._scaled_mm(
        args.mat_a, args.mat_b, args.scale_a, args.scale_b, out_dtype=torch.float32
    )
    return apply_epilogue(acc, *epilogue_factors(a_op, b_op), bias, out_dtype)


def product_backend(a_op, b_op) -> GemmBackend:
    """The backend the tensors ask for: the right operand's, or the left's if b is high
    precision."""
    owner = b_op if isinstance(b_op, QuantizedTensor) else a_op
    return GemmBackend(getattr(owner, "gemm_backend", GemmBackend.EMULATED.value))


def plan(a_op, b_op, bias, out_dtype) -> GemmBackend:
    """The backend that runs this product: the requested one if it has a kernel for it, else the
    next one down (scaled_mm -> triton -> emulated)."""
    backend = product_backend(a_op, b_op)
    if backend is GemmBackend.SCALED_MM:
        if scaled_mm_problem(a_op, b_op, bias) is None:
            return backend
        if gemm_backend_problem(GemmBackend.TRITON, b_op.device) is not None:
            return GemmBackend.EMULATED
        backend = GemmBackend.TRITON
    if backend is GemmBackend.TRITON and triton_problem(a_op, b_op, bias, out_dtype) is None:
        return backend
    return GemmBackend.EMULATED


_RUN = {
    GemmBackend.EMULATED: emulated_mm,
    GemmBackend.TRITON: triton_mm,
    GemmBackend.SCALED_MM: native_scaled_mm,
}


def gemm_plan(a, b, bias=None, out_dtype=None) -> GemmBackend:
    """Which backend `quantized_mm(a, b, bias, out_dtype)` would run on."""
    a_op, b_op = operands(a, b)
    return plan(a_op, b_op, bias, out_dtype or a.dtype)


def quantized_mm(a, b, bias=None, out_dtype=None) -> torch.Tensor:
    """a [.., M, K] @ b [.., K, N] (+ bias [N]) where either operand may be quantized."""
    a_op, b_op = operands(a, b)
    out_dtype = out_dtype or a.dtype
    return _RUN[plan(a_op, b_op, bias, out_dtype)](a_op, b_op, bias, out_dtype)


def with_gemm_backend(x: QuantizedTensor, backend: GemmBackend | str) -> QuantizedTensor:
    """x with its products forced onto `backend` (the explicit override); raises if that backend
    cannot run on x's device."""
    if isinstance(x, HybridTensor):
        return x.replace(
            rowwise=with_gemm_backend(x.rowwise, backend),
            columnwise=with_gemm_backend(x.columnwise, backend),
        )
    backend = GemmBackend(backend)
    problem = gemm_backend_problem(backend, x.device)
    if problem:
        raise ValueError(f"Cannot set gemm_backend={backend.value!r} on {x!r}: {problem}.")
    return x.replace(gemm_backend=backend.value)


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
    """F.linear with a quantized weight: quantizes x first when the weight carries an act_spec."""
    spec = getattr(weight, "act_spec", None)
    if spec is not None and not isinstance(x, QuantizedTensor):
        # Activations are not checked for NaN/Inf: the check would cost a device sync per
        # layer; a non-finite activation poisons its amax and decodes to NaN instead.
        x = quantize_spec(x, spec, check_finite=False)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    out = _triton_linear(x2, weight, bias, x.dtype)
    if out is None:
        out = quantized_mm(x2, weight.t(), bias, out_dtype=x.dtype)
    return out.reshape(*lead, out.shape[-1])


QuantizedTensor._function_table[torch.nn.functional.linear] = linear

# torch._grouped_mm's handler lives beside this layer and registers on import.
from qtensor.ops import grouped_gemm as _grouped_gemm  # noqa: E402,F401
