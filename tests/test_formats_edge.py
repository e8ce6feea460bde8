"""Edge cases of every format: the NaN/Inf policy on all 65,536 bf16 bit patterns, zeros, one
huge outlier, E4M3 block-scale boundaries, and the errors bad inputs and conflicting options get.

NaN/Inf policy (docs/formats.md, "Non-finite inputs"): `from_hp` refuses non-finite input by
default (check_finite=True). With check_finite=False the bytes follow the hardware, and nothing
non-finite ever decodes to a finite number:
- E2M1 casts NaN to code 7 (+6) and +-Inf to +-6 (codes 7 / 15);
- NVFP4: a non-finite value makes its amax (the tensor's, or its row's when row-scaled)
  non-finite, and every element decoded with that amax is non-finite: NaN poisons everything
  (scales E4M3 NaN, codes 7), Inf decodes to +-Inf, or NaN where the code is 0;
- MXFP8: a block holding NaN or Inf gets scale code 255 (NaN) and decodes to NaN; other blocks
  are untouched;
- MXFP4 fake quantization: a block holding NaN or Inf becomes NaN (tests/test_formats_mxfp4.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    NVFP4_GOLDEN_SPECS,
    all_bf16_patterns,
    as_bytes,
    assert_bits_equal,
    unpack_codes,
)
from qtensor import HybridTensor, MXFP8Spec, MXFP8Tensor, NVFP4Spec, NVFP4Tensor, quantized_mm
from qtensor.formats import elements, mxfp8, nvfp4

NAN, INF = float("nan"), float("inf")


def nv_kwargs(spec: NVFP4Spec) -> dict:
    return {f: getattr(spec, f) for f in ("block_2d", "row_scaled", "fourover6", "e4m3_bound",
                                          "rht", "stochastic_rounding", "columnwise")}


ZERO_NVFP4 = dict(NVFP4_GOLDEN_SPECS, sr=NVFP4Spec(stochastic_rounding=True),
                  rht_col=NVFP4Spec(rht=True, columnwise=True))


# ---- non-finite inputs --------------------------------------------------------------------------


def test_e2m1_cast_of_non_finite_follows_the_hardware():
    v = torch.tensor([NAN, -NAN, INF, -INF, 7.0, -1e30])
    assert elements.e2m1_encode(v).tolist() == [7, 7, 7, 15, 7, 15]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize(
    "make",
    [
        lambda x: NVFP4Tensor.from_hp(x),
        lambda x: NVFP4Tensor.from_hp(x, row_scaled=True),
        lambda x: NVFP4Tensor.from_hp(x, columnwise=True, rht=True),
        lambda x: MXFP8Tensor.from_hp(x, scale_rule="floor"),
        lambda x: HybridTensor.from_hp(x, rowwise=NVFP4Spec(), columnwise=MXFP8Spec()),
    ],
    ids=["nvfp4", "nvfp4_rowscaled", "nvfp4_rht_col", "mxfp8", "hybrid"],
)
def test_from_hp_refuses_non_finite_by_default(make, bad):
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    x[3, 17] = bad
    x[30, 1] = bad
    message = r"2 non-finite value\(s\).*shape \(32, 64\).*check_finite=False"
    with pytest.raises(ValueError, match=message):
        make(x)


def test_nvfp4_all_bf16_patterns_nan_poisons_everything():
    x = all_bf16_patterns().reshape(128, 512)  # holds +-0, subnormals, +-Inf and 254 NaNs
    with pytest.raises(ValueError, match="non-finite"):
        NVFP4Tensor.from_hp(x)
    for kw in ({}, {"block_2d": True}, {"fourover6": "mse", "e4m3_bound": 256},
               {"columnwise": True}, {"columnwise": True, "rht": True}):
        t = NVFP4Tensor.from_hp(x, check_finite=False, **kw)
        assert bool(t.amax.isnan()), kw
        assert bool(t.scale.float().isnan().all()), kw
        assert bool((t.qdata == 0x77).all()), kw  # every code 7: NaN casts to +6
        assert bool(t.dequantize(torch.float32).isnan().all()), kw


@pytest.mark.parametrize("columnwise", [False, True])
def test_nvfp4_row_scaled_poisons_only_the_rows_holding_non_finite(columnwise):
    x = all_bf16_patterns().reshape(128, 512)
    if columnwise:
        x = x.t().contiguous()
    t = NVFP4Tensor.from_hp(x, row_scaled=True, columnwise=columnwise, check_finite=False)
    m = x.t() if columnwise else x  # rows of the storage: one amax each
    dq = t.dequantize(torch.float32)
    dq = dq.t() if columnwise else dq
    bad = ~torch.isfinite(m).all(1)
    assert int(bad.sum()) == 2  # the rows holding 0x7F80..0x7FFF and 0xFF80..0xFFFF
    assert bool(t.amax[bad].isnan().all())
    assert bool((~torch.isfinite(dq[bad])).all())
    alone = nvfp4.quantize(m[~bad], NVFP4Spec(row_scaled=True))
    assert torch.equal(t.qdata[~bad], alone.qdata)
    assert torch.equal(as_bytes(t.scale)[~bad], as_bytes(alone.scale))
    # finite rows decode finite, up to the NVFP4 decode range (see the next test)
    in_range = ~bad & (m.float().abs().amax(1) <= 2.0**118)
    assert int(in_range.sum()) > 100 and bool(torch.isfinite(dq[in_range]).all())


def test_nvfp4_decode_range():
    """docs/formats.md, NVFP4 step 7, computes r(s_b * A) first: with s_b up to B = 448 it
    overflows fp32 once A > FLT_MAX / 448 (about 2**119.2). Such a tensor's largest blocks decode
    to +-Inf (NaN where a code is 0); the bytes are still right, and a GEMM (which applies
    A * r(1/(36 B_a B_b)) to the fp32 sum) is not affected the same way. docs/formats.md,
    "Decode range of NVFP4", states the range."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)) * 1e-3
    x[0, 0] = 3.0  # A = 3 * 2**125: blocks with s_b > 2.7 overflow, these small ones (~0.4) don't
    ok = NVFP4Tensor.from_hp(x * 2.0**117).dequantize(torch.float32)
    assert bool(torch.isfinite(ok).all())
    big = NVFP4Tensor.from_hp(x * 2.0**125)
    assert as_bytes(big.scale)[0, 0].item() == 0x7E  # 448: the amax block
    dq = big.dequantize(torch.float32)
    assert dq[0, 0].item() == INF and bool(torch.isfinite(dq[1:]).all())


def test_nvfp4_inf_without_nan_decodes_non_finite_everywhere():
    x = torch.randn(32, 64).to(torch.bfloat16)
    x[0, :16] = 0.0  # a zero block: its codes are 0, so it decodes 0 * Inf = NaN
    x[5, 3] = -INF
    for kw in ({}, {"block_2d": True}, {"fourover6": "mae"}, {"stochastic_rounding": True}):
        t = NVFP4Tensor.from_hp(x, check_finite=False, **kw)
        # S_enc = r(6B / Inf) = 0 -> 1, as docs/formats.md, NVFP4 step 2, says
        assert t.amax.item() == INF
        dq = t.dequantize(torch.float32)
        assert not bool(torch.isfinite(dq).any()), kw
        assert dq[5, 3].item() == -INF and bool(dq[0, :16].isnan().all())


def test_mxfp8_all_bf16_patterns_non_finite_blocks_are_nan():
    x = all_bf16_patterns().reshape(2048, 32)
    with pytest.raises(ValueError, match="non-finite"):
        MXFP8Tensor.from_hp(x)
    bad = ~torch.isfinite(x).all(1)
    clean = x.masked_fill(bad[:, None], 0.0)
    for rule in ("rceil", "floor"):
        t = MXFP8Tensor.from_hp(x, scale_rule=rule, check_finite=False)
        codes = as_bytes(t.scale)[:, 0]
        assert bool((codes[bad] == 255).all()) and bool((codes[~bad] < 255).all())
        dq = t.dequantize(torch.float32)
        assert bool(dq[bad].isnan().all())
        ref = mxfp8.quantize(clean, MXFP8Spec(rule))  # finite blocks do not see their neighbours
        assert torch.equal(as_bytes(t.qdata)[~bad], as_bytes(ref.qdata)[~bad])
        assert torch.equal(codes[~bad], as_bytes(ref.scale)[~bad, 0])
        # A finite block decodes non-finite only where its exact value leaves fp32: bf16's
        # largest, (2 - 2**-7) * 2**127, rounds to E4M3 256 at scale 2**120, i.e. 2**128.
        exact = t.qdata.double() * torch.exp2(codes.double() - 127)[:, None]
        overflow = exact.abs() > torch.finfo(torch.float32).max
        assert torch.equal(~torch.isfinite(dq[~bad]), overflow[~bad])


def test_mxfp8_columnwise_non_finite_block():
    x = torch.randn(64, 32)
    x[40, 7] = INF
    t = MXFP8Tensor.from_hp(x, columnwise=True, check_finite=False)
    assert as_bytes(t.scale)[1, 7].item() == 255
    dq = t.dequantize(torch.float32)
    assert bool(dq[32:, 7].isnan().all()) and bool(torch.isfinite(dq[:, :7]).all())


def test_dynamic_activation_nan_is_poisoned_not_raised():
    """F.linear does not sync to check activations; a NaN activation decodes to NaN outputs."""
    w = torch.randn(48, 64).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    x[2, 5] = NAN
    per_row = NVFP4Tensor.from_hp(w).replace(act_spec=NVFP4Spec(row_scaled=True))
    out = F.linear(x, per_row)
    assert bool(out[2].isnan().all()) and bool(torch.isfinite(out[[0, 1, 3]]).all())
    per_tensor = NVFP4Tensor.from_hp(w).replace(act_spec=NVFP4Spec())
    assert bool(F.linear(x, per_tensor).isnan().all())
    mx = MXFP8Tensor.from_hp(w).replace(act_spec=MXFP8Spec())
    out = F.linear(x, mx)
    assert bool(out[2].isnan().all()) and bool(torch.isfinite(out[[0, 1, 3]]).all())


# ---- zeros ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(ZERO_NVFP4))
def test_nvfp4_all_zero_tensor(config):
    spec = ZERO_NVFP4[config]
    t = NVFP4Tensor.from_hp(torch.zeros(32, 64, dtype=torch.bfloat16), **nv_kwargs(spec))
    assert bool((t.qdata == 0).all()) and bool((as_bytes(t.scale) == 0).all())
    assert bool((t.amax == 0).all())
    dq = t.dequantize(torch.float32)
    assert_bits_equal(dq, torch.zeros(32, 64), config)  # +0 exactly: no NaN, no -0


def test_nvfp4_negative_zero_tensor_keeps_the_sign():
    t = NVFP4Tensor.from_hp(torch.full((16, 32), -0.0))
    assert bool((t.qdata == 0x88).all()) and bool((as_bytes(t.scale) == 0).all())
    assert_bits_equal(t.dequantize(torch.float32), torch.full((16, 32), -0.0), "-0")


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_mxfp8_all_zero_tensor(rule, columnwise):
    t = MXFP8Tensor.from_hp(torch.zeros(64, 64), scale_rule=rule, columnwise=columnwise)
    assert bool((as_bytes(t.qdata) == 0).all()) and bool((as_bytes(t.scale) == 0).all())
    assert_bits_equal(t.dequantize(torch.float32), torch.zeros(64, 64), "zeros")


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_4o6", "nvfp4_rowscaled", "mxfp8"])
def test_zero_blocks_inside_a_tensor(fmt):
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[:, 32:64] = 0.0
    x[8:16] = 0.0  # all-zero rows too (row-scaled amax 0)
    make = {
        "nvfp4": lambda: NVFP4Tensor.from_hp(x),
        "nvfp4_4o6": lambda: NVFP4Tensor.from_hp(x, fourover6="mae", e4m3_bound=256),
        "nvfp4_rowscaled": lambda: NVFP4Tensor.from_hp(x, row_scaled=True),
        "mxfp8": lambda: MXFP8Tensor.from_hp(x),
    }[fmt]
    dq = make().dequantize(torch.float32)
    assert bool(torch.isfinite(dq).all())
    assert_bits_equal(dq[:, 32:64], torch.zeros(32, 32), "zero blocks")
    assert_bits_equal(dq[8:16], torch.zeros(8, 128), "zero rows")


# ---- one huge outlier ----------------------------------------------------------------------------


def test_nvfp4_huge_outlier_zeroes_tiny_blocks():
    x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 1e-3).to(torch.bfloat16)
    x[7, 9] = 1e30
    t = NVFP4Tensor.from_hp(x)
    scale = as_bytes(t.scale)
    # r(6 * 448 / 1e30) * 1e-3 / 6 is ~1e-30, far below E4M3's smallest 2**-9: scale 0, and the
    # block encode scale FLT_MAX pushes every nonzero element to +-6 (codes 7 / 15)
    assert scale[7, 0].item() == 0x7E  # 448: the outlier's block uses the full E4M3 range
    tiny = torch.ones_like(scale, dtype=torch.bool)
    tiny[7, 0] = False
    assert bool((scale[tiny] == 0).all())
    codes = unpack_codes(t.qdata).reshape(32, 4, 16)
    nonzero = x.reshape(32, 4, 16) != 0
    assert bool(((codes == 7) | (codes == 15))[nonzero & tiny[..., None]].all())
    dq = t.dequantize(torch.float32)
    expect = torch.zeros(32, 64)
    expect[7, 9] = dq[7, 9]
    assert torch.equal(dq.abs(), expect.abs())  # +-0 everywhere else
    torch.testing.assert_close(dq[7, 9], torch.tensor(1e30).bfloat16().float(), rtol=1e-6, atol=0)
    # row scaling confines the damage to the outlier's row
    rs = NVFP4Tensor.from_hp(x, row_scaled=True).dequantize(torch.float32)
    assert bool((rs[torch.arange(32) != 7] != 0).float().mean() > 0.9)


def test_mxfp8_outlier_does_not_touch_other_blocks():
    x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 1e-3).to(torch.bfloat16)
    y = x.clone()
    y[7, 9] = 1e30
    a, b = MXFP8Tensor.from_hp(x), MXFP8Tensor.from_hp(y)
    keep = torch.ones(32, 2, dtype=torch.bool)
    keep[7, 0] = False
    assert torch.equal(as_bytes(a.scale)[keep], as_bytes(b.scale)[keep])


# ---- E4M3 block-scale boundaries (NVFP4) ---------------------------------------------------------

# With A = 2688, S_enc = 1 and a block of amax 6v gets scale e4m3(v) (6v * r(1/6) rounds back to v
# for v with few mantissa bits). Expected E4M3 values, by hand: ties go to the even mantissa.
E4M3_CASES = [
    (1.0625, 1.0),  # midpoint of 1 and 1.125 -> 1 (mantissa 000)
    (1.1875, 1.25),  # midpoint of 1.125 and 1.25 -> 1.25 (mantissa 010)
    (272.0, 256.0),  # midpoint of 256 and 288 -> 256
    (304.0, 320.0),  # midpoint of 288 and 320 -> 320
    (2.0**-9, 2.0**-9),  # smallest subnormal, exact
    (1.5 * 2.0**-10, 2.0**-9),  # above the midpoint of 0 and 2**-9
    (2.0**-10, 0.0),  # the midpoint of 0 and 2**-9 -> 0
    (448.0, 448.0),  # the tensor-amax block: full range
]


def test_e4m3_block_scale_boundaries():
    x = torch.zeros(len(E4M3_CASES) + 1, 16)
    x[0, 0] = 2688.0
    for i, (v, _) in enumerate(E4M3_CASES):
        x[i + 1, :2] = torch.tensor([6 * v, -3 * v])
    t = nvfp4.quantize(x, NVFP4Spec())
    assert t.scale.float()[1:, 0].tolist() == [s for _, s in E4M3_CASES]
    codes = unpack_codes(t.qdata)[1:, :2]
    zero = torch.tensor([s == 0 for _, s in E4M3_CASES])
    assert bool((codes[zero] == torch.tensor([7, 15])).all())  # scale 0: +-6 ...
    dq = NVFP4Tensor.from_hp(x).dequantize(torch.float32)[1:, :2]
    assert bool((dq[zero] == 0).all())  # ... decoding to 0
    assert bool((dq[~zero] != 0).all())


# ---- bad inputs and conflicting options ---------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [lambda x: NVFP4Tensor.from_hp(x), lambda x: MXFP8Tensor.from_hp(x)],
    ids=["nvfp4", "mxfp8"],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn, torch.float64, torch.bool])
def test_wrong_dtype(make, dtype):
    x = torch.ones(32, 64).to(dtype)
    with pytest.raises(TypeError, match=f"float32, bfloat16 or float16 tensors; got {dtype}"):
        make(x)


def test_quantized_input_is_refused():
    q = NVFP4Tensor.from_hp(torch.randn(32, 64))
    with pytest.raises(TypeError, match="quantizes a high-precision tensor; got NVFP4Tensor"):
        MXFP8Tensor.from_hp(q)


@pytest.mark.parametrize(
    "make,shape,message",
    [
        (lambda x: NVFP4Tensor.from_hp(x), (4, 24),
         r"last dim divisible by 16; got shape \(4, 24\)"),
        (lambda x: NVFP4Tensor.from_hp(x, columnwise=True), (24, 32),
         r"columnwise blocks run along dim 0.*divisible by 16; got shape \(24, 32\)"),
        (lambda x: NVFP4Tensor.from_hp(x, block_2d=True), (24, 32),
         r"2D tiles are 16x16.*got shape \(24, 32\)"),
        (lambda x: NVFP4Tensor.from_hp(x, columnwise=True), (2, 16, 32),
         r"columnwise quantization takes a 2-D tensor; got shape \(2, 16, 32\)"),
        (lambda x: MXFP8Tensor.from_hp(x), (4, 48),
         r"last dim divisible by 32; got shape \(4, 48\)"),
        (lambda x: MXFP8Tensor.from_hp(x, columnwise=True), (48, 32),
         r"dim 0 divisible by 32; got shape \(48, 32\)"),
        (lambda x: NVFP4Tensor.from_hp(x), (0, 32), r"non-empty tensor; got shape \(0, 32\)"),
        (lambda x: MXFP8Tensor.from_hp(x), (0, 32), r"non-empty tensor; got shape \(0, 32\)"),
        (lambda x: NVFP4Tensor.from_hp(x), (), r"got shape \(\)"),
    ],
)
def test_bad_shapes(make, shape, message):
    with pytest.raises(ValueError, match=message):
        make(torch.ones(shape))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(fourover6="mae", rht=True, columnwise=True), "4over6 excludes RHT and stochastic"),
        (dict(fourover6="mse", stochastic_rounding=True), "4over6 excludes RHT and stochastic"),
        (dict(row_scaled=True, block_2d=True), "row_scaled excludes block_2d"),
        (dict(row_scaled=True, stochastic_rounding=True), "row_scaled excludes block_2d, rht and"),
        (dict(rht=True), "RHT applies only to columnwise .* set columnwise=True"),
        (dict(e4m3_bound=300), "e4m3_bound must be 448 or 256; got 300"),
        (dict(fourover6="max"), "fourover6 must be None, 'mae' or 'mse'; got 'max'"),
    ],
)
def test_conflicting_nvfp4_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NVFP4Tensor.from_hp(torch.randn(32, 64), **kwargs)
    with pytest.raises(ValueError, match=message):
        NVFP4Spec(**kwargs)


def test_bad_mxfp8_and_hybrid_options():
    with pytest.raises(ValueError, match="scale_rule must be 'rceil' or 'floor'; got 'even'"):
        MXFP8Tensor.from_hp(torch.randn(32, 64), scale_rule="even")
    with pytest.raises(ValueError, match="columnwise_source must be one of"):
        HybridTensor.from_hp(torch.randn(32, 64), rowwise=NVFP4Spec(), columnwise=MXFP8Spec(),
                             columnwise_source="dequantized")
    with pytest.raises(ValueError, match=r"takes a 2-D tensor; got shape \(2, 32, 64\)"):
        HybridTensor.from_hp(torch.randn(2, 32, 64), rowwise=NVFP4Spec(), columnwise=MXFP8Spec())


def test_zero_tensor_gemm_is_zero():
    a = NVFP4Tensor.from_hp(torch.zeros(16, 64))
    b = NVFP4Tensor.from_hp(torch.zeros(32, 64)).t()
    out = quantized_mm(a, b, out_dtype=torch.float32)
    assert_bits_equal(out, torch.zeros(16, 32), "zero GEMM")


def test_nvfp4_tiny_amax_keeps_the_clamp():
    """docs/formats.md, NVFP4 step 2, clamps S_enc at FLT_MAX: below amax 6B / FLT_MAX
    (~7.9e-36) the block scales fall short of B and the round trip degrades toward a relative
    error of 1 (kept as Transformer Engine's reference does; docs/formats.md, "Tiny tensors")."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    x = x / x.abs().max()

    def worst(amax):
        t = NVFP4Tensor.from_hp(x * amax)
        dq = t.dequantize(torch.float32).double()
        return ((dq - (x * amax).double()).abs().max() / amax).item(), t.scale.float().max()

    err, top = worst(1e-30)
    assert top.item() == 448.0 and err < 0.2  # an ordinary tensor: its amax block scale is B
    err, top = worst(1e-37)
    assert top.item() < 448.0 and 0.5 < err <= 0.997, (top, err)


def test_mxfp8_inf_block_gets_the_nan_scale():
    """A block with an Inf and no NaN gets scale code 0xFF (NaN) under both rules, so it decodes
    to NaN and never to a finite number (docs/formats.md, "Non-finite inputs")."""
    x = torch.randn(4, 64)
    x[1, 3] = INF
    for rule in ("rceil", "floor"):
        t = MXFP8Tensor.from_hp(x, scale_rule=rule, check_finite=False)
        codes = as_bytes(t.scale)
        assert codes[1, 0].item() == 0xFF and codes[1, 1].item() != 0xFF
        dq = t.dequantize(torch.float32)
        assert bool(dq[1, :32].isnan().all()) and bool(dq[1, 32:].isfinite().all())
