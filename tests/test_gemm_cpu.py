"""The CPU GEMM kernels (csrc/gemm_cpu.cpp, [Note: CPU GEMM kernel] in qtensor/ops/gemm_ops.py).

- qtensor::cpu_units gives the reference's unit values (`units`) bit for bit on every data byte
  and every scale byte of NVFP4, MXFP4 and MXFP8, on every instruction set this CPU runs.
- qtensor::cpu_weight_mm (the dense ops' CPU product up to cpu_fused_max_m() rows) equals the
  reference up to the order of the fp32 additions: within K * 2**-23 times the sum of the
  absolute products (and K half-steps of fp32's smallest subnormal, for products that underflow),
  and for bf16 / fp16 outputs one unit in the last place more; on M = 1 .. 256, N and K off
  every tile, bf16, fp16 and fp32 activations, quantized and non-contiguous activations,
  per-tensor and row-scaled NVFP4, bounds 448 and 256, bias, zero weights, outliers past fp32's
  range, MX scales down to 2**-127, NaN scales, 3-D activations and empty shapes.
- The ops reach it (their output is the kernel's, bit for bit), its bits are those of the
  order the docs state (modelled here), and they depend on K alone: not on the other rows, the
  threads or the instruction set.
- Above the row limit, for 3-D weights and for a quantized left operand times a float right one
  the ops give the reference's bits exactly; a grouped product gives each expert's dense
  product's bits; a weight in the decode layout gives its canonical bytes' bits.
"""

from __future__ import annotations

import pytest
import torch

from qtensor import MXFP4Tensor, MXFP8Tensor, NVFP4Tensor
from qtensor.gemm.dense import dense_sides
from qtensor.ops import gemm_ops
from qtensor.ops.gemm_operands import Side, apply_epilogue, epilogue_factors, units

pytestmark = pytest.mark.skipif(not gemm_ops.cpu_kernels_built(),
                                reason="the qtensor._C extension with the CPU GEMM kernels")

FORMATS = ("nvfp4", "mxfp4", "mxfp8")
CODE = {"nvfp4": 0, "mxfp4": 1, "mxfp8": 2}
DTYPES = {"nvfp4": (torch.uint8, torch.float8_e4m3fn), "mxfp4": (torch.uint8, torch.uint8),
          "mxfp8": (torch.float8_e4m3fn, torch.float8_e8m0fnu)}


def _isas() -> list[int]:
    """The instruction sets this CPU runs (0 baseline, 1 AVX2, 2 AVX-512): each call with a
    higher one is refused."""
    d = torch.zeros(1, 8, dtype=torch.uint8)
    s = torch.zeros(1, 1, dtype=torch.uint8)
    out = []
    for isa in (0, 1, 2):
        try:
            torch.ops.qtensor.cpu_units(d, s, 0, isa)
        except RuntimeError as e:
            assert "what this CPU runs" in str(e)
            break
        out.append(isa)
    return out


ISAS = _isas()


def _weight(fmt: str, n: int, k: int, g: torch.Generator, *, scales=None):
    """(data, scale) of a random weight [N, K] in its storage dtypes: every code pattern; finite
    scales unless given (NVFP4: every finite non-negative E4M3 byte; MX: 2**-27 .. 2**22)."""
    width = k if fmt == "mxfp8" else k // 2
    data = torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)
    if fmt == "mxfp8":
        data[(data & 0x7F) == 0x7F] = 0x7E
    blocks = k // (16 if fmt == "nvfp4" else 32)
    if scales is None:
        lo, hi = (0, 0x7F) if fmt == "nvfp4" else (100, 150)
        scales = torch.randint(lo, hi, (n, blocks), dtype=torch.uint8, generator=g)
    dd, sd = DTYPES[fmt]
    return data.view(dd), scales.view(sd)


def _side(fmt, data, scale, *, amax=None, bound=448):
    if fmt == "nvfp4" and amax is None:
        amax = torch.tensor(3.5)
    return Side(data, scale, amax if fmt == "nvfp4" else None, bound)


def _op(fmt, a: Side, b: Side, bias, out_dtype):
    return gemm_ops.op(f"{fmt}_mm")(*gemm_ops.dense_args(fmt, a, b, bias, out_dtype))


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, except that a NaN may carry another sign or payload."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def _magnitude(fmt, a: Side, b: Side) -> torch.Tensor:
    """The epilogue applied to |units(a)| @ |units(b)|^T: each output's sum of absolute
    products, scaled as the output is."""
    acc = units(fmt, a).abs() @ units(fmt, b).abs().transpose(-1, -2)
    left, right = epilogue_factors(fmt, a, b)
    left = left.abs() if isinstance(left, torch.Tensor) else left
    right = right.abs() if isinstance(right, torch.Tensor) else right
    return apply_epilogue(acc, left, right, None, torch.float32)


def assert_within_summation_bound(out, fmt, a: Side, b: Side, bias) -> None:
    """out against the reference: each of the two fp32 sums of K products is within
    (K - 1) 2**-24 of the sum of the absolute products of the exact sum, so they differ by at
    most K 2**-23 times it (the epilogue's multiplies scale that alike); a bf16 or fp16 output
    may round to either side of that interval: one unit in its last place more. Non-finite
    outputs must be the reference's."""
    ref = gemm_ops.reference_mm(fmt, a, b, bias, out.dtype)
    ref32 = gemm_ops.reference_mm(fmt, a, b, bias, torch.float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    k = units(fmt, b).shape[-1]
    tol = (k * 2.0**-23 * _magnitude(fmt, a, b) + k * 2.0**-150)[finite]
    o, r = out[finite].float(), ref32[finite]
    if out.dtype != torch.float32:
        big = torch.maximum(o.abs(), r.abs())
        tol = tol + torch.finfo(out.dtype).eps * big.clamp(min=torch.finfo(out.dtype).tiny)
    excess = ((o - r).abs() - tol).max().item() if o.numel() else 0.0
    assert excess <= 0, f"{out.dtype} results beyond the fp32 summation bound by {excess:.3e}"


# ---- cpu_units: the reference's unit values, bit for bit ---------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_units_equal_the_reference_on_every_byte_and_scale(fmt):
    """Rows of every data byte (NVFP4 / MXFP4: all 256 code pairs; MXFP8: all 256 E4M3 bytes,
    NaN included) against every scale byte (E4M3 scales: every byte, NaN and negative ones
    included; UE8M0: every code, 2**-127, 2**127 past fp32's range with large codes, and 255
    NaN)."""
    block = 16 if fmt == "nvfp4" else 32
    width = 256 if fmt == "mxfp8" else 128  # 256 elements a row
    k = 256
    rows = 256
    data = ((torch.arange(width)[None, :] + 7 * torch.arange(rows)[:, None]) % 256).to(torch.uint8)
    blocks = k // block
    scale = ((torch.arange(blocks)[None, :] * (256 // blocks) + torch.arange(rows)[:, None])
             % 256).to(torch.uint8)
    dd, sd = DTYPES[fmt]
    side = Side(data.view(dd), scale.view(sd))
    want = units(fmt, side)
    assert not torch.isfinite(want).all()  # the NaN and overflow cases are in the sample
    for isa in ISAS:
        got = torch.ops.qtensor.cpu_units(side.data, side.scale, CODE[fmt], isa)
        _bits_equal(got, want)
    _bits_equal(gemm_ops.cpu_units(fmt, side), want)


def test_units_of_3d_operands_and_views():
    g = torch.Generator().manual_seed(1)
    data, scale = _weight("nvfp4", 6, 64, g)
    side = Side(data.reshape(2, 3, 32), scale.reshape(2, 3, 4))
    _bits_equal(gemm_ops.cpu_units("nvfp4", side), units("nvfp4", side))
    view = Side(data[::2], scale[::2])  # rows with a stride: copied, then decoded
    _bits_equal(gemm_ops.cpu_units("nvfp4", view), units("nvfp4", view))


# ---- cpu_weight_mm: the reference up to the order of the additions ------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 100, 256])
def test_weight_only_product_is_the_reference(fmt, m):
    g = torch.Generator().manual_seed(m)
    for n, k in ((80, 96), (37, 2080)):
        data, scale = _weight(fmt, n, k, g)
        b = _side(fmt, data, scale)
        x = torch.randn(m, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        for out_dtype in (torch.float32, torch.bfloat16):
            out = _op(fmt, Side(x), b, bias if out_dtype == torch.float32 else None, out_dtype)
            assert_within_summation_bound(out, fmt, Side(x), b,
                                          bias if out_dtype == torch.float32 else None)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp16_and_fp32_activations(fmt, x_dtype):
    g = torch.Generator().manual_seed(5)
    data, scale = _weight(fmt, 50, 512, g)
    b = _side(fmt, data, scale)
    x = torch.randn(7, 512, generator=g).to(x_dtype)
    out = _op(fmt, Side(x), b, None, torch.float16 if x_dtype == torch.float16 else torch.float32)
    assert_within_summation_bound(out, fmt, Side(x), b, None)


@pytest.mark.parametrize("bound", [448, 256])
def test_nvfp4_row_scaled_and_bounds(bound):
    g = torch.Generator().manual_seed(bound)
    data, scale = _weight("nvfp4", 64, 256, g)
    amax = torch.rand(64, generator=g) * 10 + 0.1
    b = _side("nvfp4", data, scale, amax=amax, bound=bound)
    x = torch.randn(3, 256, generator=g).bfloat16()
    bias = torch.randn(64, generator=g)
    out = _op("nvfp4", Side(x), b, bias, torch.bfloat16)
    assert_within_summation_bound(out, "nvfp4", Side(x), b, bias)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_quantized_activations(fmt):
    """Both operands quantized (the dynamic configs): the activation's unit values, exact in
    fp32, enter the same kernel."""
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    w = torch.randn(48, 256, dtype=torch.bfloat16)
    cls = NVFP4Tensor if fmt == "nvfp4" else MXFP8Tensor
    f, a, b, _ = dense_sides(cls.from_hp(x), cls.from_hp(w).t())
    out = _op(f, a, b, None, torch.float32)
    assert_within_summation_bound(out, f, a, b, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_weights_outliers_and_nan_scales(fmt):
    g = torch.Generator().manual_seed(9)
    k = 128
    data, scale = _weight(fmt, 40, k, g)
    data.view(torch.uint8)[:8] = 0
    s = scale.view(torch.uint8)
    if fmt == "nvfp4":
        s[8:16] = 0x7E  # 448: the largest finite block scale
        s[16, 1] = 0x7F  # NaN
    else:
        s[8:16, 0] = 254  # 2**127: past fp32's range, the units are inf
        s[16, 1] = 255  # NaN
        s[20:30] = torch.arange(10, dtype=torch.uint8)[:, None]  # 2**-127 .. 2**-118
    b = _side(fmt, data, scale)
    x = torch.randn(6, k, generator=g).bfloat16()
    x[:, ::17] *= 1000
    for out_dtype in (torch.float32, torch.bfloat16):
        out = _op(fmt, Side(x), b, None, out_dtype)
        assert_within_summation_bound(out, fmt, Side(x), b, None)
        assert (out[:, :8] == 0).all()
        assert torch.isnan(out[:, 16]).all()


def test_3d_activations():
    g = torch.Generator().manual_seed(3)
    data, scale = _weight("mxfp4", 24, 64, g)
    b = _side("mxfp4", data, scale)
    x = torch.randn(2, 5, 64, generator=g).bfloat16()
    out = _op("mxfp4", Side(x), b, None, torch.float32)
    assert out.shape == (2, 5, 24)
    assert_within_summation_bound(out, "mxfp4", Side(x), b, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_ops_run_the_kernel(fmt):
    """The op's output is the kernel's sums through the reference's epilogue, bit for bit, and
    (with fp32 activations, whose products round) not the reference's own bits everywhere."""
    g = torch.Generator().manual_seed(21)
    data, scale = _weight(fmt, 96, 1024, g)
    b = _side(fmt, data, scale)
    x = torch.randn(5, 1024, generator=g)
    bias = torch.randn(96, generator=g)
    out = _op(fmt, Side(x), b, bias, torch.float32)
    acc = torch.ops.qtensor.cpu_weight_mm(x, data, scale, CODE[fmt])
    assert torch.equal(out, apply_epilogue(acc, *epilogue_factors(fmt, Side(x), b), bias,
                                           torch.float32))
    assert not torch.equal(out, gemm_ops.reference_mm(fmt, Side(x), b, bias, torch.float32))


def test_the_isa_is_the_best_the_cpu_runs():
    assert torch.ops.qtensor.cpu_gemm_isa() == ISAS[-1]
    assert gemm_ops.cpu_fused_max_m() == gemm_ops.CPU_FUSED_MAX_M[ISAS[-1]]


def test_non_contiguous_activations():
    g = torch.Generator().manual_seed(6)
    data, scale = _weight("mxfp8", 24, 256, g)
    b = _side("mxfp8", data, scale)
    x = torch.randn(256, 6, generator=g).bfloat16().t()  # [6, 256], column-major
    assert not x.is_contiguous()
    out = _op("mxfp8", Side(x), b, None, torch.float32)
    assert torch.equal(out, _op("mxfp8", Side(x.contiguous()), b, None, torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_shapes(fmt):
    """No rows, no weight rows, or K = 0: the reference's shapes and values (zeros plus bias)."""
    g = torch.Generator().manual_seed(8)
    for m, n, k in ((0, 16, 64), (3, 0, 64), (3, 16, 0)):
        data, scale = _weight(fmt, n, k, g)
        b = _side(fmt, data, scale)
        x = torch.randn(m, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g)
        out = _op(fmt, Side(x), b, bias, torch.float32)
        assert torch.equal(out, gemm_ops.reference_mm(fmt, Side(x), b, bias, torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_layout_weight_above_the_row_limit(fmt):
    from qtensor.formats import decode_layout as dl
    from qtensor.ops import decode_mm  # noqa: F401  (registers qtensor::decode_mm)

    g = torch.Generator().manual_seed(13)
    n, k = 48, 128
    data, scale = _weight(fmt, n, k, g)
    b = _side(fmt, data, scale)
    codes, scales = dl.pack(fmt, data.view(torch.uint8), scale.view(torch.uint8), n, k)
    for m in (3, gemm_ops.cpu_fused_max_m() + 1):
        x = torch.randn(m, k, generator=g).bfloat16()
        out = torch.ops.qtensor.decode_mm(x, codes, scales, b.amax, None, fmt, n, k, 448,
                                          torch.float32)
        assert torch.equal(out, _op(fmt, Side(x), b, None, torch.float32))


# ---- the order of the additions: K alone ---------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_and_instruction_sets_give_the_same_bits(fmt):
    """A row's output is the same alone, inside any batch (every tile shape of the kernel), in
    a concatenated weight, on one thread or two, and on every instruction set."""
    g = torch.Generator().manual_seed(11)
    n, k = 2051, 320  # 4-5 tasks of about 400 weight rows: two threads split them
    data, scale = _weight(fmt, n, k, g)
    x = torch.randn(17, k, generator=g)  # fp32: the products are rounded, the order shows
    full = torch.ops.qtensor.cpu_weight_mm(x, data, scale, CODE[fmt])
    for i in (0, 5, 16):
        alone = torch.ops.qtensor.cpu_weight_mm(x[i:i + 1], data, scale, CODE[fmt])
        assert torch.equal(alone[0], full[i])
    for m in (2, 3, 4, 8):
        assert torch.equal(torch.ops.qtensor.cpu_weight_mm(x[:m], data, scale, CODE[fmt]),
                           full[:m])
    other, other_scale = _weight(fmt, 7, k, g)
    both = torch.ops.qtensor.cpu_weight_mm(x, torch.cat([other, data]),
                                           torch.cat([other_scale, scale]), CODE[fmt])
    assert torch.equal(both[:, 7:], full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.qtensor.cpu_weight_mm(x, data, scale, CODE[fmt]), full)
    finally:
        torch.set_num_threads(threads)
    for isa in ISAS:
        assert torch.equal(torch.ops.qtensor.cpu_weight_mm(x, data, scale, CODE[fmt], isa), full)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_documented_order(fmt):
    """The sums in the order docs/gemm.md states, modelled here: lane l adds x[k] * u[k] for
    k = l, l + 16, ... by fused multiply-adds (each the exact fp64 value rounded once to fp32:
    a bf16 value times a unit is exact in fp64, and so is its sum with an fp32 here), then the
    lanes by halves (l + 8, then 4, 2, 1 apart) in fp32; every instruction set gives its bits."""
    g = torch.Generator().manual_seed(19)
    n, k, m = 37, 512, 9
    data, scale = _weight(fmt, n, k, g)
    u = units(fmt, Side(data, scale)).double()
    x = torch.randn(m, k, generator=g).bfloat16()
    acc = torch.zeros(m, n, 16, dtype=torch.float32)
    for k0 in range(0, k, 16):
        prod = x[:, None, k0:k0 + 16].double() * u[None, :, k0:k0 + 16]
        acc = (acc.double() + prod).float()
    for w in (8, 4, 2, 1):
        acc = acc[..., :w] + acc[..., w:2 * w]
    want = acc[..., 0]
    for isa in ISAS:
        assert torch.equal(torch.ops.qtensor.cpu_weight_mm(x, data, scale, CODE[fmt], isa), want)


# ---- the exact paths: above the row limit, 3-D weights, grouped products -------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_above_the_row_limit_the_bits_are_the_reference(fmt):
    g = torch.Generator().manual_seed(2)
    data, scale = _weight(fmt, 24, 64, g)
    b = _side(fmt, data, scale)
    x = torch.randn(gemm_ops.cpu_fused_max_m() + 1, 64, generator=g).bfloat16()
    out = _op(fmt, Side(x), b, None, torch.bfloat16)
    assert torch.equal(out, gemm_ops.reference_mm(fmt, Side(x), b, None, torch.bfloat16))
    b3 = _side(fmt, data[None], scale[None])
    out = _op(fmt, Side(x[:4][None]), b3, None, torch.float32)
    assert torch.equal(out, gemm_ops.reference_mm(fmt, Side(x[:4][None]), b3, None,
                                                  torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_left_high_precision_right_is_the_reference(fmt):
    """A quantized left operand times a float right one: the left's units decoded once (C++),
    torch.matmul, the reference's bits."""
    g = torch.Generator().manual_seed(17)
    data, scale = _weight(fmt, 6, 64, g)
    a = _side(fmt, data, scale)
    b = Side(torch.randn(10, 64, generator=g))
    out = _op(fmt, a, b, None, torch.float32)
    assert torch.equal(out, gemm_ops.reference_mm(fmt, a, b, None, torch.float32))


def test_grouped_product_bits_are_each_experts_dense_product():
    # Each expert's rows are the dense CPU product of its weight, bit for bit (the kernel's
    # within the row limit), so within the fp32 summation bound of the reference.
    g = torch.Generator().manual_seed(4)
    data, scale = _weight("mxfp8", 3 * 16, 64, g)
    b = Side(data.reshape(3, 16, 64), scale.reshape(3, 16, 2))
    x = torch.randn(10, 64, generator=g).bfloat16()
    ends = [3, 3, 10]
    args = gemm_ops.grouped_args("mxfp8", Side(x), b, torch.tensor(ends, dtype=torch.int32),
                                 None, torch.float32)
    out = gemm_ops.op("mxfp8_grouped_mm")(*args)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            a_e, b_e = Side(x[start:end]), Side(b.data[e], b.scale[e])
            dense = gemm_ops.op("mxfp8_mm")(*gemm_ops.dense_args("mxfp8", a_e, b_e, None,
                                                                 torch.float32))
            assert torch.equal(out[start:end], dense), f"expert {e}"
            assert_within_summation_bound(out[start:end], "mxfp8", a_e, b_e, None)
        start = end


# ---- through the tensors, eager, compiled, and their gradient ------------------------------------


@pytest.mark.parametrize("cls", [NVFP4Tensor, MXFP8Tensor, MXFP4Tensor])
def test_linear_layer_eager_compiled_and_gradient(cls):
    """F.linear with a quantized weight: the kernel's product, the gradient of x from the exact
    unit values (fp64 check), and the compiled layer bitwise equal to the eager one."""
    torch.manual_seed(0)
    qw = cls.from_hp(torch.randn(64, 128, dtype=torch.bfloat16))
    x = torch.randn(4, 128, requires_grad=True)  # fp32: fp32 output
    out = torch.nn.functional.linear(x, qw)
    fmt, a, b, _ = dense_sides(x.detach(), qw.t())
    assert_within_summation_bound(out.detach(), fmt, a, b, None)
    out.square().sum().backward()
    # dx = (2 out * left * right) @ units(W), an fp32 sum of N = 64 terms: within 64 2**-23 of
    # its absolute terms' sum (the two epilogue multiplies round too: 2 2**-24 more).
    left, right = epilogue_factors(fmt, a, b)
    scale = float(left if left is not None else 1.0) * float(right if right is not None else 1.0)
    d, u = 2 * out.detach().double() * scale, units(fmt, b).double()
    excess = (x.grad.double() - d @ u).abs() - 66 * 2.0**-23 * (d.abs() @ u.abs())
    assert excess.max() <= 0
    compiled = torch.compile(lambda t: torch.nn.functional.linear(t, qw), fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x.detach()), torch.nn.functional.linear(x.detach(), qw))
    xc = x.detach().clone().requires_grad_()
    compiled(xc).square().sum().backward()  # the gradient compiled too: cpu_units's fake
    assert torch.equal(xc.grad, x.grad)


# ---- errors -------------------------------------------------------------------------------------


def test_errors_name_the_requirement():
    g = torch.Generator().manual_seed(0)
    data, scale = _weight("nvfp4", 8, 64, g)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"x is \[M, K = 64\]; got \[2, 32\]"):
        torch.ops.qtensor.cpu_weight_mm(x[:, :32], data, scale, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16; got Int"):
        torch.ops.qtensor.cpu_weight_mm(x.int(), data, scale, 0)
    with pytest.raises(RuntimeError, match=r"needs scales \[8, 4\] \(one per 16 elements\)"):
        torch.ops.qtensor.cpu_weight_mm(x, data, scale[:, :2], 0)
    with pytest.raises(RuntimeError, match="fmt is 0 \\(NVFP4\\), 1 \\(MXFP4\\) or 2"):
        torch.ops.qtensor.cpu_units(data, scale, 3)
    with pytest.raises(RuntimeError, match="what this CPU runs"):
        torch.ops.qtensor.cpu_units(data, scale, 0, 7)
    with pytest.raises(RuntimeError, match="2-D bytes"):
        torch.ops.qtensor.cpu_units(data.float(), scale, 0)
