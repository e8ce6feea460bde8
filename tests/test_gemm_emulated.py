"""The emulated GEMM (qtensor/gemm/dense.py) against an fp64 oracle written here: the product of the
operands' exact unit values, decoded from their bytes by this file, times the epilogue factors
of [Note: emulated GEMM] (A_a * A_b / (36 B_a B_b) for NVFP4 x NVFP4, A / (6 B) with one NVFP4
operand, per-row / per-column amax for row-scaled operands), plus bias, in the output dtype.
The emulated result must match within fp32 accumulation error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import e2m1_values, unpack_codes
from qtensor import HybridTensor, MXFP8Spec, MXFP8Tensor, NVFP4Spec, NVFP4Tensor, quantized_mm


def _x(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


# ---- the oracle ----------------------------------------------------------------------------------


def units(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp64 unit values in the logical layout, amax factor, 1/(6B) factor) of one operand.

    Factors are 1 where the format has none. Unit values come straight from the bytes:
    NVFP4 value(code) * s_b, MXFP8 e4m3 * 2**(code - 127), high precision as itself."""
    one = torch.ones((), dtype=torch.float64)
    if isinstance(t, NVFP4Tensor):
        vals = e2m1_values(unpack_codes(t.qdata))  # storage layout [.., R, C]
        s = t.scale.double().repeat_interleave(16, dim=-1)
        u = vals * s
        amax = t.amax.double()
        if t.axis == "columnwise":
            u = u.transpose(-1, -2)
            amax = amax.unsqueeze(-2) if t.row_scaled else amax  # per logical column
        elif t.row_scaled:
            amax = amax.unsqueeze(-1)  # per logical row
        return u, amax, one / (6 * t.e4m3_bound)
    if isinstance(t, MXFP8Tensor):
        codes = t.scale.view(torch.uint8).double()
        dim = -1 if t.axis == "rowwise" else -2
        return t.qdata.double() * torch.exp2(codes - 127).repeat_interleave(32, dim=dim), one, one
    return t.double(), one, one


def oracle(a, b, bias=None):
    """(expected fp64 result, error bound) of a @ b (+ bias) per [Note: emulated GEMM]."""
    ua, amax_a, inv_a = units(a)
    ub, amax_b, inv_b = units(b)
    factor = amax_a * amax_b * inv_a * inv_b
    want = (ua @ ub) * factor
    magnitude = (ua.abs() @ ub.abs()) * factor.abs()
    # fp32 accumulation over K terms (each product exact), then 3 fp32 epilogue roundings
    bound = magnitude * 2.0**-24 * (ua.shape[-1] + 8)
    if bias is not None:
        want = want + bias.double()
        bound = bound + want.abs() * 2.0**-23
    return want, bound


def assert_matches(got, want, bound, dtype):
    assert got.dtype == dtype
    cast = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    err = (got.double() - want).abs()
    limit = bound + want.abs() * cast + (2.0**-24 if dtype == torch.float16 else 0)
    assert bool((err <= limit).all()), float((err - limit).max())
    assert bool(torch.isfinite(got).all())


# ---- NVFP4 x NVFP4 ------------------------------------------------------------------------------


NVFP4_PAIRS = {
    "scalar": (dict(), dict()),
    "row_scaled_both": (dict(row_scaled=True), dict(row_scaled=True)),
    "row_scaled_left": (dict(row_scaled=True), dict()),
    "bound_448_x_256": (dict(), dict(fourover6="mae", e4m3_bound=256)),
    "4o6_2d_weight": (dict(fourover6="mse", e4m3_bound=256), dict(block_2d=True, fourover6="mse",
                                                                  e4m3_bound=256)),
}


@pytest.mark.parametrize("pair", sorted(NVFP4_PAIRS))
def test_nvfp4_x_nvfp4(pair):
    ka, kb = NVFP4_PAIRS[pair]
    x = _x(24, 128, seed=1, scale=torch.logspace(-2, 2, 24)[:, None])  # rows of spread scale
    w = _x(48, 128, seed=2)
    a = NVFP4Tensor.from_hp(x, **ka)
    b = NVFP4Tensor.from_hp(w, **kb).t()  # [K, N], columnwise: rows of w are its columns
    want, bound = oracle(a, b)
    assert_matches(quantized_mm(a, b, out_dtype=torch.float32), want, bound, torch.float32)
    assert_matches(torch.mm(a, b), want, bound, torch.bfloat16)  # the left operand's dtype
    assert torch.equal(a @ b, torch.mm(a, b))


def test_columnwise_quantized_right_operand_equals_transposed_rowwise():
    """A right operand quantized columnwise from w^T [K, N] has the same bytes as w's rowwise."""
    w = _x(48, 128, seed=3)
    a = NVFP4Tensor.from_hp(_x(16, 128, seed=4))
    b1 = NVFP4Tensor.from_hp(w).t()
    b2 = NVFP4Tensor.from_hp(w.t().contiguous(), columnwise=True)
    assert torch.equal(quantized_mm(a, b1), quantized_mm(a, b2))


def test_bias_and_output_dtype():
    a = NVFP4Tensor.from_hp(_x(16, 64, seed=5))
    b = NVFP4Tensor.from_hp(_x(32, 64, seed=6)).t()
    bias = _x(32, seed=7)
    want, bound = oracle(a, b, bias)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_matches(quantized_mm(a, b, bias, out_dtype=dtype), want, bound, dtype)
    assert_matches(torch.addmm(bias, a, b), want, bound, torch.bfloat16)
    assert_matches(torch.mm(a.to(torch.float32), b), *oracle(a, b), torch.float32)
    with pytest.raises(ValueError, match="beta=1 and alpha=1 only"):
        torch.addmm(bias, a, b, beta=0.5)


# ---- MXFP8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_x_mxfp8(rule):
    a = MXFP8Tensor.from_hp(_x(24, 128, seed=8, scale=100.0), scale_rule=rule)
    b = MXFP8Tensor.from_hp(_x(40, 128, seed=9), scale_rule=rule).t()
    want, bound = oracle(a, b)
    assert_matches(quantized_mm(a, b, out_dtype=torch.float32), want, bound, torch.float32)
    b_col = MXFP8Tensor.from_hp(_x(40, 128, seed=9).t().contiguous(), scale_rule=rule,
                                columnwise=True)
    assert torch.equal(quantized_mm(a, b_col), quantized_mm(a, b))


# ---- weight-only: high-precision activation x quantized weight ---------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_rowscaled", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_weight_only_linear(fmt, dtype):
    w = _x(48, 64, seed=10)
    wq = {"nvfp4": lambda: NVFP4Tensor.from_hp(w),
          "nvfp4_rowscaled": lambda: NVFP4Tensor.from_hp(w, row_scaled=True),
          "mxfp8": lambda: MXFP8Tensor.from_hp(w)}[fmt]()
    x = _x(2, 5, 64, seed=11).to(dtype)
    bias = _x(48, seed=12).to(dtype)
    got = F.linear(x, wq, bias)
    assert got.shape == (2, 5, 48)
    want, bound = oracle(x.reshape(10, 64), wq.t(), bias)
    assert_matches(got.reshape(10, 48), want, bound, dtype)


# ---- dynamic activations through F.linear, 3-D inputs --------------------------------------------


@pytest.mark.parametrize(
    "weight,act",
    [
        (dict(), NVFP4Spec()),
        (dict(), NVFP4Spec(row_scaled=True)),
        (dict(fourover6="mae", e4m3_bound=256), NVFP4Spec(fourover6="mae", e4m3_bound=256)),
        ("mxfp8", MXFP8Spec()),
    ],
)
def test_dynamic_activation_linear_3d(weight, act):
    w = _x(32, 64, seed=13)
    wq = MXFP8Tensor.from_hp(w) if weight == "mxfp8" else NVFP4Tensor.from_hp(w, **weight)
    wq = wq.replace(act_spec=act)
    x = _x(3, 4, 64, seed=14)
    got = F.linear(x, wq)
    flat = F.linear(x.reshape(12, 64), wq)
    assert torch.equal(got.reshape(12, 32), flat)
    cls = NVFP4Tensor if isinstance(act, NVFP4Spec) else MXFP8Tensor
    xq = cls.from_spec(x.reshape(12, 64), act)
    assert_matches(flat, *oracle(xq, wq.t()), torch.bfloat16)


# ---- batched products ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_rowscaled", "mxfp8"])
def test_bmm(fmt):
    x, w = _x(3, 16, 64, seed=15), _x(3, 32, 64, seed=16)
    if fmt == "mxfp8":
        a, b = MXFP8Tensor.from_hp(x), MXFP8Tensor.from_hp(w).transpose(-1, -2)
    else:
        kw = dict(row_scaled=fmt == "nvfp4_rowscaled")
        a, b = NVFP4Tensor.from_hp(x, **kw), NVFP4Tensor.from_hp(w, **kw).transpose(-1, -2)
    assert b.shape == (3, 64, 32)
    want, bound = oracle(a, b)
    got = torch.bmm(a, b)
    assert got.shape == (3, 16, 32)
    assert_matches(got, want, bound, torch.bfloat16)
    assert torch.equal(torch.matmul(a, b), got)
    # a 3-D left operand times a 2-D weight folds the batch into the rows
    b2 = b.select(0, 0)
    assert torch.equal(torch.matmul(a, b2)[1], torch.mm(a.select(0, 1), b2))
    assert torch.equal(a.expand(3, -1, 64).dequantize(), a.dequantize())  # what matmul emits
    with pytest.raises(ValueError, match="cannot be broadcast .* blocks and scales would be"):
        a.expand(2, 3, 16, 64)


# ---- hybrid operands -----------------------------------------------------------------------------


def test_hybrid_weight_serves_fprop_in_nvfp4_and_dgrad_in_mxfp8():
    w = _x(64, 64, seed=17)  # [N, K]
    h = HybridTensor.from_hp(w, rowwise=NVFP4Spec(), columnwise=MXFP8Spec(),
                             columnwise_source="rowwise_dequantized")
    # fprop y = x @ W^T: W^T's columnwise side is W's NVFP4 rowwise side, transposed
    xq = NVFP4Tensor.from_hp(_x(16, 64, seed=18))
    want, bound = oracle(xq, h.rowwise.t())
    assert_matches(quantized_mm(xq, h.t()), want, bound, torch.bfloat16)
    x = _x(16, 64, seed=18)
    assert_matches(F.linear(x, h), *oracle(x, h.rowwise.t()), torch.bfloat16)
    # dgrad dX = dY @ W: W's columnwise side (MXFP8, blocks along N) is the right operand
    dy = MXFP8Tensor.from_hp(_x(16, 64, seed=19))
    want, bound = oracle(dy, h.columnwise)
    assert_matches(quantized_mm(dy, h), want, bound, torch.bfloat16)
    # the MXFP8 side was quantized from the rowwise side decoded to bf16
    again = MXFP8Tensor.from_hp(h.rowwise.dequantize(torch.bfloat16), columnwise=True)
    assert torch.equal(again.qdata.view(torch.uint8), h.columnwise.qdata.view(torch.uint8))
    with pytest.raises(TypeError, match="one format; got NVFP4Tensor x MXFP8Tensor"):
        quantized_mm(NVFP4Tensor.from_hp(_x(16, 64, seed=19)), h)


# ---- errors --------------------------------------------------------------------------------------


def test_wrong_orientation_and_mixed_formats():
    a = NVFP4Tensor.from_hp(_x(16, 64))
    b_rowwise = NVFP4Tensor.from_hp(_x(64, 32))  # [K, N] with blocks along N: wrong for a right
    with pytest.raises(ValueError, match=r"right operand .* blocks along the reduction dim "
                                         r"\(columnwise\).*columnwise=True or pass its transpose"):
        quantized_mm(a, b_rowwise)
    with pytest.raises(ValueError, match=r"left operand .*\(rowwise\)"):
        quantized_mm(NVFP4Tensor.from_hp(_x(16, 64), columnwise=True), b_rowwise.t())
    with pytest.raises(TypeError, match="both operands in one format"):
        torch.mm(a, MXFP8Tensor.from_hp(_x(32, 64)).t())
    with pytest.raises(ValueError, match="RHT-transformed NVFP4 operand needs an RHT-transformed"):
        quantized_mm(_x(16, 64), NVFP4Tensor.from_hp(_x(64, 32), columnwise=True, rht=True))


def test_plain_mm_with_dynamic_activation_weight_refuses():
    # The act_spec of a dynamic-activation weight is applied by F.linear only; a direct mm would
    # otherwise run weight-only math without saying so.
    w = NVFP4Tensor.from_hp(torch.randn(32, 64, dtype=torch.bfloat16))
    w = w.replace(act_spec=NVFP4Spec())
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quantizes its activation inside F.linear"):
        torch.mm(x, w.t())
    assert torch.nn.functional.linear(x, w).shape == (8, 32)


# ---- products of a transposed operand without its view -----------------------------------------


def _hybrid(x, cls, **kw):
    row = cls.from_hp(x, **kw)
    col = cls.from_hp(x, columnwise=True, **kw)
    return HybridTensor(x.shape, x.dtype, x.device, rowwise=row, columnwise=col,
                        columnwise_source="original")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_quantized_mm_t_equals_the_transposed_views(fmt):
    """quantized_mm_t(a, b, a_t, b_t) is quantized_mm on a.t() / b.t(), bit for bit, and matches
    the oracle: fprop's x @ w.t() and wgrad's dy.t() @ x on hybrids, single-usage tensors and a
    bf16 left operand."""
    from qtensor.gemm.dense import quantized_mm_t

    cls = NVFP4Tensor if fmt == "nvfp4" else MXFP8Tensor
    x, w, dy = _x(64, 128, seed=1), _x(96, 128, seed=2), _x(64, 96, seed=3, scale=1e-2)
    hx, hw, hdy = _hybrid(x, cls), _hybrid(w, cls), _hybrid(dy, cls)
    cases = [
        ((hx, hw), dict(b_t=True), (hx, hw.t())),  # fprop
        ((hdy, hx), dict(a_t=True), (hdy.t(), hx)),  # wgrad
        ((cls.from_hp(x), cls.from_hp(w)), dict(b_t=True), (cls.from_hp(x), cls.from_hp(w).t())),
        ((cls.from_hp(dy, columnwise=True), cls.from_hp(x, columnwise=True)), dict(a_t=True),
         (cls.from_hp(dy, columnwise=True).t(), cls.from_hp(x, columnwise=True))),
        ((x, hw), dict(b_t=True), (x, hw.t())),  # a bf16 activation
    ]
    bias = _x(96, seed=4)
    for (a, b), flags, (va, vb) in cases:
        for bb in ((bias, None) if vb.shape[-1] == 96 else (None,)):
            got = quantized_mm_t(a, b, bb, torch.float32, **flags)
            ref = quantized_mm(va, vb, bb, out_dtype=torch.float32)
            assert torch.equal(got, ref), flags
            # The oracle reads the part each side multiplies (a hybrid hands over one).
            pa = va.gemm_operand("left") if isinstance(va, HybridTensor) else va
            pb = vb.gemm_operand("right") if isinstance(vb, HybridTensor) else vb
            want, bound = oracle(pa, pb, bb)
            assert_matches(got, want, bound, torch.float32)


def test_quantized_mm_t_takes_the_regular_path_elsewhere():
    """A batched operand and a wrong orientation go through quantized_mm: the same result, and
    the same error naming the operand to transpose."""
    from qtensor.gemm.dense import quantized_mm_t

    w = NVFP4Tensor.from_hp(_x(48, 128, seed=2))
    x3 = _x(2, 8, 128, seed=1)
    assert torch.equal(quantized_mm_t(x3, w, b_t=True), quantized_mm(x3, w.t()))
    col = NVFP4Tensor.from_hp(_x(48, 128, seed=2), columnwise=True)  # blocks along dim 0
    with pytest.raises(ValueError, match="right operand of a quantized GEMM") as got:
        quantized_mm_t(_x(8, 48, seed=1), col, b_t=True)
    with pytest.raises(ValueError) as ref:
        quantized_mm(_x(8, 48, seed=1), col.t())
    assert str(got.value) == str(ref.value)
