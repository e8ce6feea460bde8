"""The GEMM ops (qtensor::nvfp4_mm, mxfp8_mm, mxfp4_mm, their grouped forms and fp8_block_mm): torch.library.opcheck,
the reference against an independent fp64 product of dequantized operands, autograd, errors,
and the eager direct call against the dispatcher.

The independent oracle: fp64 matmul of `dequantize()` (each element decoded with its own
per-block factor), against which the reference (fp32 unit values, one fp32 epilogue) differs
only by fp32 rounding: relative Frobenius error well under 1e-5 at these sizes.
"""

from __future__ import annotations

import pytest
import torch

from qtensor import HybridTensor, MXFP4Tensor, MXFP8Spec, MXFP8Tensor, NVFP4Tensor
from qtensor.ops import gemm_ops
from qtensor.ops.gemm_operands import Side

devices = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


# opcheck's test_schema compares inputs before and after with torch.allclose, which torch does
# not implement for float8 dtypes ("mul_cpu_reduced_float" not implemented for
# 'Float8_e4m3fn'), and every operand here carries float8 scales or data. The same two
# properties are checked by `check_schema` instead: no input changes (bytewise) and the output
# aliases no input.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
    check_schema(op, args)


def _bytes(t):
    return t.detach().contiguous().view(torch.uint8).clone() if t.dim() else t.detach().clone()


def check_schema(op, args):
    before = [_bytes(a) if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(_bytes(a), b), f"{op} mutated input {i}"
            assert not torch._C._overlaps(out, a), f"{op}'s output aliases input {i}"


def _gen(device, seed):
    return torch.Generator(device).manual_seed(seed)


def nv_side(t: NVFP4Tensor) -> Side:
    return Side(t.qdata, t.scale, t.amax, t.e4m3_bound)


def mx_side(t: MXFP8Tensor, right: bool) -> Side:
    return Side(t.qdata.transpose(-1, -2), t.scale.transpose(-1, -2)) if right else Side(
        t.qdata, t.scale)


def m4_side(t: MXFP4Tensor) -> Side:
    return Side(t.qdata, t.scale)  # rowwise: a left operand's rows; columnwise: a right one's


def dense_cases(device):
    """(name, fmt, a Side, b Side, bias, a_hp [.., M, K], b_hp [.., N, K]): b_hp / a_hp are the
    dequantized operands (fp64 oracle)."""
    g = _gen(device, 0)
    x = torch.randn(24, 96, device=device, generator=g)
    w = torch.randn(40, 96, device=device, generator=g) * 0.05
    bias = torch.randn(40, device=device, generator=g).bfloat16()
    xb = x.bfloat16()
    nw = NVFP4Tensor.from_hp(w)
    nw_rs = NVFP4Tensor.from_hp(w, row_scaled=True, e4m3_bound=256)
    nx_rs = NVFP4Tensor.from_hp(x, row_scaled=True)
    mw, mx = MXFP8Tensor.from_hp(w), MXFP8Tensor.from_hp(x)
    mw_col = MXFP8Tensor.from_hp(w.t().contiguous(), columnwise=True)  # [K, N] columnwise
    x3 = torch.randn(3, 24, 96, device=device, generator=g)
    w3 = torch.randn(3, 40, 96, device=device, generator=g)
    n3x, n3w = NVFP4Tensor.from_hp(x3, row_scaled=True), NVFP4Tensor.from_hp(w3)
    m4w, m4x = MXFP4Tensor.from_hp(w), MXFP4Tensor.from_hp(x)
    m4w_col = MXFP4Tensor.from_hp(w.t().contiguous(), columnwise=True)  # [K, N] columnwise
    m43w = MXFP4Tensor.from_hp(w3)

    def dq(t):
        return t.dequantize(torch.float64)

    return [
        ("bf16_x_nvfp4", "nvfp4", Side(xb), nv_side(nw), bias, xb.double(), dq(nw)),
        ("nvfp4_rowscaled_x_rowscaled_256", "nvfp4", nv_side(nx_rs), nv_side(nw_rs), None,
         dq(nx_rs), dq(nw_rs)),
        ("nvfp4_x_fp32", "nvfp4", nv_side(nx_rs), Side(w), None, dq(nx_rs), w.double()),
        ("nvfp4_batched", "nvfp4", nv_side(n3x), nv_side(n3w), None, dq(n3x), dq(n3w)),
        ("bf16_broadcast_x_nvfp4_batched", "nvfp4", Side(xb), nv_side(n3w), None, xb.double(),
         dq(n3w)),
        ("bf16_x_mxfp8", "mxfp8", Side(xb), mx_side(mw, False), bias, xb.double(), dq(mw)),
        ("mxfp8_x_mxfp8_columnwise", "mxfp8", mx_side(mx, False), mx_side(mw_col, True), bias,
         dq(mx), dq(mw_col).t()),
        ("bf16_x_mxfp4", "mxfp4", Side(xb), m4_side(m4w), bias, xb.double(), dq(m4w)),
        ("mxfp4_x_mxfp4_columnwise", "mxfp4", m4_side(m4x), m4_side(m4w_col), bias, dq(m4x),
         dq(m4w_col).t()),
        ("mxfp4_x_fp32", "mxfp4", m4_side(m4x), Side(w), None, dq(m4x), w.double()),
        ("bf16_broadcast_x_mxfp4_batched", "mxfp4", Side(xb), m4_side(m43w), None, xb.double(),
         dq(m43w)),
    ]


@pytest.mark.parametrize("device", devices)
def test_dense_ops_pass_opcheck(device):
    for name, fmt, a, b, bias, _, _ in dense_cases(device):
        for out_dtype in (torch.bfloat16, torch.float32):
            args = gemm_ops.dense_args(fmt, a, b, bias, out_dtype)
            opcheck(gemm_ops.op(f"{fmt}_mm"), args)


@pytest.mark.parametrize("device", devices)
def test_dense_op_autograd_passes_opcheck(device):
    """A high-precision operand that requires grad: the autograd registration is checked."""
    for name, fmt, a, b, bias, _, _ in dense_cases(device)[:1] + dense_cases(device)[5:6] + \
            dense_cases(device)[7:8]:
        a = Side(a.data.detach().clone().requires_grad_(True))
        bias = bias.detach().clone().requires_grad_(True)
        opcheck(gemm_ops.op(f"{fmt}_mm"), gemm_ops.dense_args(fmt, a, b, bias, torch.float32))


@pytest.mark.parametrize("device", devices)
def test_dense_ops_match_fp64_of_dequantized_operands(device):
    for name, fmt, a, b, bias, a_hp, b_hp in dense_cases(device):
        out = gemm_ops.op(f"{fmt}_mm")(*gemm_ops.dense_args(fmt, a, b, bias, torch.float32))
        ref = torch.matmul(a_hp, b_hp.transpose(-1, -2))
        if bias is not None:
            ref = ref + bias.double()
        assert out.shape == ref.shape, name
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("device", devices)
def test_direct_call_equals_the_dispatcher(device):
    for name, fmt, a, b, bias, _, _ in dense_cases(device):
        args = gemm_ops.dense_args(fmt, a, b, bias, torch.bfloat16)
        direct = gemm_ops.call(f"{fmt}_mm", *args)
        assert torch.equal(direct, gemm_ops.op(f"{fmt}_mm")(*args)), name


def test_direct_call_is_skipped_when_autograd_or_a_mode_needs_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    name, fmt, a, b, bias, _, _ = dense_cases("cpu")[0]
    args = gemm_ops.dense_args(fmt, a, b, bias, torch.bfloat16)
    with Record():
        gemm_ops.call("nvfp4_mm", *args)
    assert "qtensor.nvfp4_mm.default" in seen
    x = a.data.detach().clone().requires_grad_(True)
    out = gemm_ops.call("nvfp4_mm", *gemm_ops.dense_args(fmt, Side(x), b, bias, torch.bfloat16))
    assert out.grad_fn is not None


def test_linear_gradient_of_the_activation_and_bias():
    """F.linear with a quantized weight (weight-only and MXFP8): dX = dY @ W_dequantized and
    d bias = sum dY, against fp64 (the gradient was silently missing before the op)."""
    g = _gen("cpu", 1)
    w = torch.randn(48, 64, generator=g)
    for wq in (NVFP4Tensor.from_hp(w, row_scaled=True), MXFP8Tensor.from_hp(w)):
        x = torch.randn(2, 5, 64, generator=g).requires_grad_(True)
        bias = torch.randn(48, generator=g).requires_grad_(True)
        y = torch.nn.functional.linear(x, wq, bias)
        dy = torch.randn(y.shape, generator=g)
        y.backward(dy)
        ref_dx = dy.double() @ wq.dequantize(torch.float64)
        err = ((x.grad.double() - ref_dx).norm() / ref_dx.norm()).item()
        assert err < 1e-6, f"{type(wq).__name__}: dX relative error {err:.2e}"
        assert torch.allclose(bias.grad, dy.sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_grouped_backward_matches_per_expert_dense():
    g = _gen("cpu", 2)
    w = NVFP4Tensor.from_hp(torch.randn(3, 24, 64, generator=g), columnwise=False)
    b = w.transpose(-1, -2)  # [E, K, N] columnwise
    x = torch.randn(20, 64, generator=g).requires_grad_(True)
    offs = torch.tensor([5, 5, 17], dtype=torch.int32)
    out = torch._grouped_mm(x, b, offs)
    dy = torch.randn(out.shape, generator=g)
    out.backward(dy)
    ref = torch.zeros(20, 64, dtype=torch.float64)
    for e, (s, t) in enumerate([(0, 5), (5, 5), (5, 17)]):
        ref[s:t] = dy[s:t].double() @ w[e].dequantize(torch.float64)
    err = ((x.grad.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6, f"relative error {err:.2e}"
    assert torch.equal(x.grad[17:], torch.zeros(3, 64))


def grouped_cases(device):
    g = _gen(device, 3)
    x = torch.randn(30, 64, device=device, generator=g)
    w = torch.randn(4, 32, 64, device=device, generator=g)  # [E, N, K]
    offs = torch.tensor([4, 4, 19, 27], dtype=torch.int32, device=device)
    bias = torch.randn(4, 32, device=device, generator=g)
    nw = NVFP4Tensor.from_hp(w, row_scaled=True)
    mw = MXFP8Tensor.from_hp(w)
    return [
        ("nvfp4", Side(x.bfloat16()), nv_side(nw), offs, bias),
        ("nvfp4", nv_side(NVFP4Tensor.from_hp(x, row_scaled=True)), nv_side(nw), offs, None),
        ("mxfp8", Side(x.bfloat16()), mx_side(mw, False), offs, bias),
        ("mxfp8", mx_side(MXFP8Tensor.from_hp(x), False), mx_side(mw, False), offs, None),
        ("mxfp4", Side(x.bfloat16()), m4_side(MXFP4Tensor.from_hp(w)), offs, bias),
        ("mxfp4", m4_side(MXFP4Tensor.from_hp(x)), m4_side(MXFP4Tensor.from_hp(w)), offs, None),
    ]


@pytest.mark.parametrize("device", devices)
def test_grouped_ops_pass_opcheck(device):
    for fmt, a, b, offs, bias in grouped_cases(device):
        args = gemm_ops.grouped_args(fmt, a, b, offs, bias, torch.float32)
        opcheck(gemm_ops.op(f"{fmt}_grouped_mm"), args)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: dict(a, b_scale=a["b_scale"][:, :-1]), r"b_scale must be \(40, 6\)"),
        (lambda a: dict(a, a=a["a"][:, :64]), "K differs"),
        (lambda a: dict(a, b_amax=torch.ones(7)), "b_amax must be 0-d or one value per row"),
        (lambda a: dict(a, b_bound=300), "b_bound must be 448 or 256"),
        (lambda a: dict(a, b_scale=None), "at least one operand must be quantized"),
        (lambda a: dict(a, out_dtype=torch.int32), "out_dtype must be"),
        (lambda a: dict(a, a=a["a"].int()), "must be float32, bfloat16 or float16"),
    ],
)
def test_bad_arguments_raise_naming_the_op(mutate, match):
    name, fmt, a, b, bias, _, _ = dense_cases("cpu")[0]
    keys = ["a", "a_scale", "a_amax", "b", "b_scale", "b_amax", "a_bound", "b_bound", "bias",
            "out_dtype"]
    args = dict(zip(keys, gemm_ops.dense_args(fmt, a, b, bias, torch.bfloat16)))
    with pytest.raises(ValueError, match=r"qtensor::nvfp4_mm: .*" + match):
        gemm_ops.op("nvfp4_mm")(*mutate(args).values())


def test_quantized_left_times_hybrid_routes_through_the_op():
    """HybridTensor operands hand the op their matching side (aten.mm on the subclasses)."""
    g = _gen("cpu", 4)
    x = torch.randn(32, 64, generator=g)
    w = torch.randn(64, 64, generator=g)
    a = HybridTensor.from_hp(x, rowwise=MXFP8Spec(), columnwise=MXFP8Spec())
    b = HybridTensor.from_hp(w, rowwise=MXFP8Spec(), columnwise=MXFP8Spec()).t()
    out = torch.mm(a, b)
    ref = a.rowwise.dequantize(torch.float64) @ b.columnwise.dequantize(torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def fp8_block_cases(device):
    """(name, args of qtensor::fp8_block_mm, fp64 oracle): 1x128 rows times 1x128 rows and
    times 128x128 tiles, as the FP8 host of MXFP4 QAT feeds them (b as a transposed view)."""
    from qtensor.formats import fp8_block
    from qtensor.formats.fp8_block import FP8BlockSpec

    g = _gen(device, 5)
    x = torch.randn(48, 256, device=device, generator=g)
    w = torch.randn(128, 256, device=device, generator=g) * 0.05
    col = torch.randn(256, 128, device=device, generator=g)  # [K, N], blocks along K
    bias = torch.randn(128, device=device, generator=g).bfloat16()
    rows, tiles = FP8BlockSpec("1x128"), FP8BlockSpec("128x128")
    cols = FP8BlockSpec("1x128", columnwise=True)
    qx, qw, qc = fp8_block.quantize(x, rows), fp8_block.quantize(w, tiles), fp8_block.quantize(
        col, cols)

    def dq(q, spec):
        return fp8_block.dequantize(*q, spec, torch.float64)

    return [
        ("rows_x_tiles_bias", (*qx, *qw, True, bias), dq(qx, rows) @ dq(qw, tiles).t()
         + bias.double()),
        ("rows_x_transposed_columnwise", (*qx, qc.qdata.t(), qc.scale.t(), False, None),
         dq(qx, rows) @ dq(qc, cols)),
    ]


@pytest.mark.parametrize("device", devices)
def test_fp8_block_op_passes_opcheck_and_matches_fp64(device):
    op = gemm_ops.op("fp8_block_mm")
    for name, args, ref in fp8_block_cases(device):
        for out_dtype in (torch.bfloat16, torch.float32):
            opcheck(op, (*args, out_dtype))
        out = op(*args, torch.float32)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-6, f"{name}: relative error {err:.2e}"
        assert torch.equal(gemm_ops.call("fp8_block_mm", *args, torch.float32), out), name


def test_fp8_block_op_bias_gradient_passes_opcheck():
    name, args, _ = fp8_block_cases("cpu")[0]
    bias = args[-1].detach().clone().requires_grad_(True)
    opcheck(gemm_ops.op("fp8_block_mm"), (*args[:-1], bias, torch.float32))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a[:3] + (a[3][:, :1],) + a[4:], r"b_scale must be 128x128 tiles \(1, 2\)"),
        (lambda a: a[:4] + (False,) + a[5:], r"b_scale must be 1x128 blocks \(128, 2\)"),
        (lambda a: (a[0][:, :128],) + a[1:], "K differs"),
        (lambda a: (a[0].float(),) + a[1:], "must be 2-D float8_e4m3fn"),
        (lambda a: a[:5] + (torch.zeros(7),), r"bias must be a vector \[N\] = \[128\]"),
    ],
)
def test_fp8_block_op_bad_arguments_raise_naming_the_op(mutate, match):
    _, args, _ = fp8_block_cases("cpu")[0]
    with pytest.raises(ValueError, match=r"qtensor::fp8_block_mm: .*" + match):
        gemm_ops.op("fp8_block_mm")(*mutate(args), torch.bfloat16)
