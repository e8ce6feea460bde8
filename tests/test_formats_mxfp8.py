"""MXFP8 bytes: golden vectors, UE8M0 scale boundaries for both scale rules, decode, layouts, and
torchao's MX quantizer (to_mx, RCEIL and FLOOR) as a bit-exact second opinion."""

from __future__ import annotations

import pytest
import torch

from conftest import GOLDEN_INPUTS, MXFP8_GOLDEN_SPECS, as_bytes, assert_bytes_equal
from qtensor import MXFP8Tensor
from qtensor.formats import mxfp8
from qtensor.formats.mxfp8 import MXFP8Spec


def codes_of(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Scale codes of single-element blocks [amax, 0 x 31] through the full quantizer."""
    x = torch.zeros(amax.numel(), 32, dtype=amax.dtype)
    x[:, 0] = amax
    return as_bytes(mxfp8.quantize(x, MXFP8Spec(rule)).scale)[:, 0].int()


# ---- golden vectors ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(MXFP8_GOLDEN_SPECS))
@pytest.mark.parametrize("name", GOLDEN_INPUTS)
def test_golden_bytes(golden, name, config):
    x = golden[f"{name}/input"]
    spec = MXFP8_GOLDEN_SPECS[config]
    ref = mxfp8.quantize(x, spec)
    t = MXFP8Tensor.from_hp(x, scale_rule=spec.scale_rule, columnwise=spec.columnwise)
    for label, got in (("reference", ref), ("MXFP8Tensor.from_hp", t)):
        assert got.qdata.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.float8_e8m0fnu
        assert_bytes_equal(got.qdata, golden[f"{name}/{config}/qdata"], f"{label} {config} qdata")
        assert_bytes_equal(got.scale, golden[f"{name}/{config}/scale"], f"{label} {config} scale")


@pytest.mark.parametrize("config", sorted(MXFP8_GOLDEN_SPECS))
@pytest.mark.parametrize("name", ["bf16_all_finite", "fp32_wide", "outlier"])
def test_golden_decode_is_exact(golden, name, config):
    """Decode = e4m3 value * 2**(code - 127), computed in fp64 from the golden bytes."""
    spec = MXFP8_GOLDEN_SPECS[config]
    q = golden[f"{name}/{config}/qdata"].view(torch.float8_e4m3fn).double()
    codes = golden[f"{name}/{config}/scale"].double()
    scale = torch.exp2(codes - 127).repeat_interleave(32, dim=0 if spec.columnwise else 1)
    want = (q * scale).float()  # exact: at most 4 significant bits, in fp32 range
    t = MXFP8Tensor.from_hp(golden[f"{name}/input"], scale_rule=spec.scale_rule,
                            columnwise=spec.columnwise)
    assert torch.equal(t.dequantize(torch.float32), want)


# ---- UE8M0 scale boundaries -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rceil_boundary_at_1_75(dtype):
    """amax = m * 2**k: RCEIL code = k - 8 + [m > 1.75] + 127 (448 = 1.75 * 2**8)."""
    k = torch.arange(-117, 128, dtype=torch.float64)  # scale values 2**(k-8) stay normal
    next_up = 1.75 + (2**-23 if dtype == torch.float32 else 2**-7)
    for m, bump in ((1.0, 0), (1.5, 0), (1.75, 0), (next_up, 1), (1.9921875, 1)):
        amax = (m * torch.exp2(k)).to(dtype)
        if not bool(torch.isfinite(amax).all()):
            amax, kk = amax[:-1], k[:-1]
        else:
            kk = k
        assert torch.equal(codes_of(amax, "rceil"), (kk - 8 + bump + 127).int()), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floor_rule(dtype):
    """FLOOR: code = floor(log2 amax) - 8 + 127, clamped at 0; m does not matter."""
    k = torch.arange(-118, 128, dtype=torch.float64)
    for m in (1.0, 1.75, 1.9921875):
        amax = (m * torch.exp2(k)).to(dtype)
        assert torch.equal(codes_of(amax, "floor"), (k - 8 + 127).int()), m
    tiny = torch.tensor([2.0**-119, 2.0**-126, 2.0**-133], dtype=dtype)  # below 2**-118 -> code 0
    assert codes_of(tiny, "floor").tolist() == [0, 0, 0]


def test_floor_saturates_and_rceil_does_not():
    # amax 1.9 * 2**4: FLOOR scale 2**(4-8) puts the amax at 1.9 * 256 = 486 > 448 -> saturates;
    # RCEIL rounds the scale up to 2**-3, where the amax is 243.2 -> e4m3 240.
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.9 * 16, -1.9 * 16])
    floor = mxfp8.quantize(x, MXFP8Spec("floor"))
    rceil = mxfp8.quantize(x, MXFP8Spec("rceil"))
    assert as_bytes(floor.scale).item() == 127 - 4
    assert floor.qdata.float()[0, :2].tolist() == [448, -448]
    assert as_bytes(rceil.scale).item() == 127 - 3
    assert rceil.qdata.float()[0, :2].tolist() == [240, -240]


def test_rceil_subnormal_scale_value_rounds_up_to_code_1():
    """amax / 448 below 2**-126 is a nonzero subnormal fp32 value; rounding it up to a power of
    two on its bits gives code 1 (2**-126), never code 0. The golden vectors fix this rule."""
    amax = torch.tensor([2.0**-118, 2.0**-120, 2.0**-126, 2.0**-133, 2.0**-140])
    assert codes_of(amax, "rceil").tolist() == [1, 1, 1, 1, 1]
    # bf16 reaches down to 2**-133 (its smallest subnormal), and takes the same rule
    assert codes_of(amax[:4].to(torch.bfloat16), "rceil").tolist() == [1, 1, 1, 1]
    # 2**-149 * r(1/448) underflows to +0 in fp32: no nonzero scale value, code 0 (2**-127);
    # the element then encodes as 2**-149 * 2**127 -> e4m3 0 (it is below half of 2**-9).
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0**-149
    q = mxfp8.quantize(x, MXFP8Spec("rceil"))
    assert as_bytes(q.scale).item() == 0 and as_bytes(q.qdata)[0, 0].item() == 0


def test_zero_block_code_0_and_special_codes_decode():
    assert codes_of(torch.zeros(2), "rceil").tolist() == [0, 0]
    assert codes_of(torch.zeros(2), "floor").tolist() == [0, 0]
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    vals = mxfp8.scale_values(codes.view(torch.float8_e8m0fnu))
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert vals[:-1].tolist() == want and bool(vals[-1].isnan())
    # code 254 (2**127) still decodes; no finite input reaches it (the largest is 247, below)
    q = torch.tensor([[1.0] + [0.0] * 31]).to(torch.float8_e4m3fn)
    assert mxfp8.dequantize(q, torch.tensor([[254]], dtype=torch.uint8).view(torch.float8_e8m0fnu),
                            columnwise=False)[0, 0].item() == 2.0**127
    non_finite = torch.tensor([float("inf"), float("nan")])
    assert mxfp8.scale_codes(non_finite, "rceil").tolist() == [255, 255]


def test_largest_finite_amax_codes():
    # FLT_MAX * r(1/448) is about 2**119.2, rounded up to 2**120: code 247. FLOOR: 2**(127-8): 246.
    big = torch.tensor([torch.finfo(torch.float32).max])
    assert codes_of(big, "rceil").tolist() == [247]
    assert codes_of(big, "floor").tolist() == [246]


# ---- layouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_columnwise_is_rowwise_of_transpose_in_input_layout(rule):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    col = mxfp8.quantize(x, MXFP8Spec(rule, columnwise=True))
    row_t = mxfp8.quantize(x.t().contiguous(), MXFP8Spec(rule))
    assert col.qdata.shape == (64, 96) and col.scale.shape == (2, 96)
    assert_bytes_equal(col.qdata, row_t.qdata.t(), "qdata")
    assert_bytes_equal(col.scale, row_t.scale.t(), "scale")


def test_three_d_rowwise_blocks_run_along_the_last_dim():
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    q = mxfp8.quantize(x, MXFP8Spec())
    flat = mxfp8.quantize(x.reshape(6, 64), MXFP8Spec())
    assert q.scale.shape == (2, 3, 2)
    assert_bytes_equal(q.qdata.reshape(6, 64), flat.qdata, "qdata")
    assert_bytes_equal(q.scale.reshape(6, 2), flat.scale, "scale")


# ---- torchao's MX quantizer as a second opinion -----------------------------------------------

# torchao's eager RCEIL divides amax by 448 and takes the exponent through float math, and both of
# its modes clamp the fp32 scale to the smallest normal 2**-126 when encoding the data. Where the
# scale value is subnormal (block amax below about 448 * 2**-126 = 2**-117.2) it therefore
# disagrees with docs/formats.md ("MXFP8", subnormal scales) and the golden vectors (code 0 / data
# at 2**-126 instead of code 1, or code 0 with data at 2**-127): those blocks are left out of the
# comparison, and the subnormal rule is tested against the golden vectors and by hand above.
SUBNORMAL_SCALE_AMAX = 2.0**-117


def _wide_input(dtype, seed):
    """Blocks of random magnitude 2**-130 .. 2**120, each block with its own exponent."""
    g = torch.Generator().manual_seed(seed)
    m, k = 256, 512
    exps = torch.randint(-130, 120, (m, k // 32, 1), generator=g).expand(m, k // 32, 32)
    mant = (torch.rand(m, k, generator=g) + 0.5) * torch.rand(m, k, generator=g) ** 4
    sign = torch.randint(0, 2, (m, k), generator=g) * 2 - 1
    x = mant * sign * torch.exp2(exps.reshape(m, k).float())
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_matches_torchao_to_mx(rule, dtype):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    mode = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}[rule]
    for x in (_wide_input(dtype, 3), torch.randn(128, 256, dtype=dtype)):
        scale_ao, data_ao = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode)
        ours = mxfp8.quantize(x, MXFP8Spec(rule))
        keep = x.float().abs().reshape(x.shape[0], -1, 32).amax(-1) >= SUBNORMAL_SCALE_AMAX
        assert keep.double().mean() > 0.9
        sa = as_bytes(scale_ao).reshape(keep.shape)
        assert torch.equal(sa[keep], as_bytes(ours.scale)[keep])
        da = as_bytes(data_ao).reshape(*keep.shape, 32)
        assert torch.equal(da[keep], as_bytes(ours.qdata).reshape(*keep.shape, 32)[keep])
