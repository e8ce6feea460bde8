"""Host encodings of the MXFP4 projection: MXFP8 rowwise/columnwise, FP8 128x128, both modes."""

from __future__ import annotations

import pytest
import torch

from qtensor.formats import fp8_block, mxfp4, mxfp8
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.qat import convert

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
TILE = FP8BlockSpec("128x128")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def grid_block(e: int, sign: float = 1.0) -> torch.Tensor:
    """32 values covering every E2M1 magnitude, both signs, at block exponent e (amax 6 * 2**e)."""
    vals = torch.tensor(GRID * 4, dtype=torch.float64)
    vals[8:16] *= -1
    vals[24:] *= -1
    return (vals * sign * 2.0**e).float()


def weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(60)
    normal = torch.randn(256, 256, generator=g, dtype=torch.float32) * 0.02
    tiny = torch.stack([grid_block(e) for e in range(-126, -118)] * 32).reshape(256, 32)
    tiny = tiny.repeat(1, 8)  # blocks at e = -126 .. -119: MXFP8 scale code 0 and 1..2
    mixed = normal.clone()
    mixed[5, 64:96] = grid_block(-124)
    mixed[9, :32] = 0.0
    return [normal, normal.bfloat16(), tiny, mixed]


@pytest.mark.parametrize("direct", [False, True])
def test_mxfp8_rowwise_decodes_to_projection(direct):
    for w in weights():
        q, s = convert.mxfp8_rowwise(w, direct)
        decoded = mxfp8.dequantize(q, s, columnwise=False)
        assert torch.equal(decoded, convert.project(w).float())


def test_mxfp8_rowwise_direct_bytes_and_code_zero():
    w = weights()[2]
    codes, e = mxfp4.decompose(w)
    q, s = convert.mxfp8_rowwise(w, direct=True)
    code = u8(s).int()
    assert (code == 0).any() and (e <= -121).any()
    # The fixed shift: code e + 121 wherever that is >= 0, else 0.
    assert torch.equal(code, (e + 121).clamp(min=0))
    # Invertible where code >= 1: e = code - 121 and q = payload / 64, code for code.
    payload = q.float().reshape(*code.shape, 32)
    normal = code >= 1
    vals = mxfp4.compose(codes, e).reshape(*code.shape, 32) / torch.exp2(e.float())[..., None]
    assert torch.equal((payload / 64)[normal], vals[normal])
    # Code 0 (2**-127) absorbs q * 2**(e + 127) into the payload; decodes through the real path.
    absorbed = payload[~normal] * 2.0**-127
    assert torch.equal(absorbed, mxfp4.compose(codes, e).reshape(*code.shape, 32)[~normal])


def test_mxfp8_code_zero_through_dequantize_and_planted_codes():
    q = torch.full((1, 32), 1.0).to(torch.float8_e4m3fn)
    for code, want in ((0, 2.0**-127), (1, 2.0**-126), (254, 2.0**127), (255, float("nan"))):
        s = torch.tensor([[code]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
        got = mxfp8.dequantize(q, s, columnwise=False)[0, 0].item()
        assert (got == want) or (want != want and got != got)


@pytest.mark.parametrize("direct", [False, True])
def test_mxfp8_columnwise_is_the_host_quantizer(direct):
    for w in weights():
        q, s = convert.mxfp8_columnwise(w, direct)
        hq, hs = mxfp8.quantize(convert.project(w), mxfp8.MXFP8Spec(columnwise=True))
        assert torch.equal(u8(q), u8(hq)) and torch.equal(u8(s), u8(hs))


def test_direct_and_projection_rowwise_bytes_may_differ_values_not():
    # amax 3.2 gives e = 0 and largest code 3 (3.2 rounds to 3): RCEIL picks code e + 120,
    # the direct lift e + 121.
    w = torch.stack([grid_block(0)[:8].repeat(4) * 0.5] * 32)
    w[:, 0] = 3.2
    pq, ps = convert.mxfp8_rowwise(w, direct=False)
    dq, ds = convert.mxfp8_rowwise(w, direct=True)
    assert not torch.equal(u8(ps), u8(ds))
    assert torch.equal(mxfp8.dequantize(pq, ps, False), mxfp8.dequantize(dq, ds, False))


def test_nonfinite_blocks_poison_both_modes():
    w = weights()[0].clone()
    w[3, 40] = float("nan")
    w[200, 7] = float("inf")
    for direct in (False, True):
        q, s = convert.mxfp8_rowwise(w, direct)
        assert u8(s)[3, 1] == 255 and u8(s)[200, 0] == 255
        assert torch.isnan(mxfp8.dequantize(q, s, False)[3, 32:64]).all()
        bq, bs = convert.fp8_block_weight(w, direct)
        assert torch.isnan(bs[0, 0]) and torch.isnan(bs[1, 0]) and not torch.isnan(bs[0, 1])
        cq, cs = convert.mxfp8_columnwise(w, direct)
        assert u8(cs)[0, 40] == 255


# ---- FP8 128x128 -----------------------------------------------------------------------------


def spread_tiles(top: int, spreads) -> tuple[torch.Tensor, torch.Tensor]:
    """One 128x128 tile per spread d: block 0 of every row at exponent `top`, blocks 1..3 at
    top - d, each block holding the full E2M1 grid. Returns the weight and its exponents."""
    tiles, exps = [], []
    for d in spreads:
        e_low = max(top - d, -126)
        row = torch.cat([grid_block(top), grid_block(e_low), grid_block(e_low, -1), grid_block(e_low)])
        tiles.append(row.expand(128, 128))
        exps.append(torch.tensor([top, e_low, e_low, e_low]).expand(128, 4))
    return torch.cat(tiles, 1).contiguous(), torch.cat(exps, 1)


def predicted_exact(w: torch.Tensor, e: torch.Tensor, tile_exp: torch.Tensor) -> torch.Tensor:
    """Element-wise: payload q * 2**(e - t) lies on the E4M3 lattice (multiple of 2**-9, <= 448).

    Every q has at most two significant bits, so above 2**-6 it always fits; below, only
    multiples of the smallest subnormal 2**-9 do.
    """
    t = tile_exp.repeat_interleave(128, 0).repeat_interleave(4, 1)
    payload = w.double().reshape(*e.shape, 32) * torch.exp2(-(t.double()))[..., None]
    lattice = payload * 2.0**9
    return (lattice == lattice.round()).reshape(w.shape) & (payload.abs() <= 448).reshape(w.shape)


@pytest.mark.parametrize("direct", [False, True])
def test_fp8_block_exactness_boundary(direct):
    w, e = spread_tiles(0, range(0, 17))
    codes, e_ref = mxfp4.decompose(w)
    assert torch.equal(e_ref, e)  # the tiles hold the spreads they claim
    q, s = convert.fp8_block_weight(w, direct)
    decoded = fp8_block.dequantize(q, s, TILE)
    # Largest code 6 at the top exponent: both rules give tile exponent top - 6.
    tile_exp = torch.full((1, 17), -6)
    assert torch.equal(s, torch.exp2(tile_exp.float()))
    want = predicted_exact(w, e, tile_exp)
    assert torch.equal(decoded == w, want)
    exact_per_tile = [bool(want[:, 128 * d: 128 * (d + 1)].all()) for d in range(17)]
    assert exact_per_tile == [True] * 15 + [False, False]  # exact through 14, first loss at 15


def test_fp8_block_direct_low_end_clamp():
    w, e = spread_tiles(-120, [0, 4, 6, 10])  # bottom blocks clamp at e = -126
    small = torch.stack([grid_block(-126)] * 4, 0).reshape(1, 128).expand(128, 128)
    w = torch.cat([w, small], 1)
    q, s = convert.fp8_block_weight(w, direct=True)
    codes, e = mxfp4.decompose(w)
    t = convert.fp8_block_tile_exponent(e)
    assert t[0, -1] == -127  # 2**(-126 - 6) clamps at 2**-127
    assert torch.equal(s, torch.exp2(t.float()))
    want = predicted_exact(w, e, t)
    assert torch.equal(fp8_block.dequantize(q, s, TILE) == convert.project(w), want)
    assert want.all()


def test_fp8_block_modes_decode_equal_on_weights():
    for w in weights()[:2] + [spread_tiles(3, range(0, 15))[0]]:
        p = fp8_block.dequantize(*convert.fp8_block_weight(w, False), TILE)
        d = fp8_block.dequantize(*convert.fp8_block_weight(w, True), TILE)
        assert torch.equal(p, d) and torch.equal(d, convert.project(w).float())


def test_fp8_block_reference_quantizer():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(256, 384, generator=g) * torch.exp2(torch.randint(-8, 8, (256, 1), generator=g))
    x[0, :128] = 0.0
    # 1x128: scale = amax / 448 rounded up to a power of two (the MXFP8 RCEIL code's value).
    q, s = fp8_block.quantize(x, FP8BlockSpec("1x128"))
    amax = x.reshape(256, 3, 128).abs().amax(-1).double()
    k = torch.ceil(torch.log2(amax / 448))
    want = torch.where(amax == 0, torch.full_like(k, -127.0), k)
    assert torch.equal(torch.log2(s.double()), want)
    assert (q.float().abs().amax() <= 448) and torch.isfinite(q.float()).all()
    # Columnwise is the rowwise quantization of the transpose, in the input's layout.
    cq, cs = fp8_block.quantize(x[:, :256].t().contiguous().t(), FP8BlockSpec("1x128", True))
    tq, ts = fp8_block.quantize(x[:, :256].t(), FP8BlockSpec("1x128"))
    assert torch.equal(u8(cq), u8(tq.t())) and torch.equal(cs, ts.t())
    for bad, spec in (((100, 128), FP8BlockSpec("128x128")), ((128, 100), FP8BlockSpec())):
        with pytest.raises(ValueError, match="divisible by 128"):
            fp8_block.quantize(torch.zeros(bad), spec)
