"""The quantization kernels of csrc/ (CPU C++ and CUDA) against the reference, byte for byte.

Every test runs on the CPU kernels and, marked `cuda`, on the CUDA kernels (benchmarks/
gpu_check.sh runs those on the GPU machine). The expected bytes are the golden vectors (written
independently of qtensor) or the pure-torch reference of qtensor/formats on the same device.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import (
    GOLDEN_INPUTS,
    NVFP4_GOLDEN_SPECS,
    all_bf16_patterns,
    assert_bits_equal,
    assert_bytes_equal,
    kernel_devices,
)

from qtensor.formats import mxfp4, mxfp8, nvfp4, scale_layout
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed, sr_state_tensor
from qtensor.formats.rht import RHT_SIGNS, apply_rht
from qtensor.ops import quant as Q

pytestmark = pytest.mark.skipif(Q.EXTENSION_ERROR is not None, reason="qtensor._C is not built")
DEVICES = kernel_devices()


def _valid_specs():
    """Every NVFP4Spec the reference accepts."""
    specs = []
    for col, b2d, rs, f46, bound, rht, sr in itertools.product(
        (False, True), (False, True), (False, True), (None, "mae", "mse"), (448, 256),
        (False, True), (False, True),
    ):
        try:
            specs.append(NVFP4Spec(b2d, rs, f46, bound, rht, sr, col))
        except ValueError:
            continue
    return specs


SPECS = _valid_specs()


def kernel_nvfp4(x: torch.Tensor, spec: NVFP4Spec, sr: SRSeed | None = None):
    a = Q.amax(x, columnwise=spec.columnwise, rht=spec.rht, per_row=spec.row_scaled)
    q, s = Q.nvfp4_codes(x, a, spec, sr)
    return q, s, a


def check_nvfp4(x: torch.Tensor, spec: NVFP4Spec, sr: SRSeed | None = None) -> None:
    ref = nvfp4.quantize(x, spec, sr)
    q, s, a = kernel_nvfp4(x, spec, sr)
    what = f"{spec} {x.dtype} {tuple(x.shape)}"
    assert_bits_equal_nan(a, ref.amax, f"amax {what}")
    assert_bytes_equal(canon_nan(s), canon_nan(ref.scale), f"scale {what}")
    assert_bytes_equal(q, ref.qdata, f"codes {what}")


def canon_nan(e4m3: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes with -NaN (0xFF) read as NaN (0x7F): NaN inputs give NaN bytes, but their sign
    follows each device's NaN propagation inside torch, which is not part of the format."""
    b = e4m3.contiguous().view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b)


def assert_bits_equal_nan(a: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    # Bit for bit, except NaN payloads: not part of the formats (torch picks one per device).
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(a), nan), f"{what}: NaN positions differ"
    assert_bits_equal(a.masked_fill(nan, 0), ref.masked_fill(nan, 0), what)


# ---- golden vectors (independent implementation) ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", sorted(NVFP4_GOLDEN_SPECS))
def test_nvfp4_golden(golden, device, config):
    spec = NVFP4_GOLDEN_SPECS[config]
    for name in GOLDEN_INPUTS:
        x = golden[f"{name}/input"].to(device)
        q, s, a = kernel_nvfp4(x, spec)
        assert_bytes_equal(q.cpu(), golden[f"{name}/{config}/qdata"], f"{name}/{config} codes")
        assert_bytes_equal(s.cpu(), golden[f"{name}/{config}/scale"], f"{name}/{config} scale")
        assert_bits_equal(a.cpu(), golden[f"{name}/{config}/amax"], f"{name}/{config} amax")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_golden_both_directions_one_read(golden, device, rule):
    for name in GOLDEN_INPUTS:
        x = golden[f"{name}/input"].to(device)
        rq, rs, cq, cs = Q.mxfp8_both(x, rule, True, True)
        for q, s, config in ((rq, rs, f"mxfp8_{rule}"), (cq, cs, f"mxfp8_{rule}_col")):
            assert_bytes_equal(q.cpu(), golden[f"{name}/{config}/qdata"], f"{name}/{config} data")
            assert_bytes_equal(s.cpu(), golden[f"{name}/{config}/scale"], f"{name}/{config} scale")


# ---- every bf16 pattern --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columnwise", [False, True])
def test_nvfp4_all_bf16_patterns_row_scaled(device, columnwise):
    # One block per amax row, so NaN and Inf stay in their own rows (a global NaN amax would
    # poison everything): finite, +-0, subnormal, +-inf and NaN patterns all go through.
    x = all_bf16_patterns().reshape(4096, 16).to(device)
    x = x.t().contiguous() if columnwise else x
    check_nvfp4(x, NVFP4Spec(row_scaled=True, columnwise=columnwise))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [NVFP4Spec(), NVFP4Spec(fourover6="mse", e4m3_bound=256),
                                  NVFP4Spec(block_2d=True),
                                  NVFP4Spec(fourover6="mae", block_2d=True)], ids=str)
def test_nvfp4_all_finite_bf16_patterns(device, spec):
    p = all_bf16_patterns()
    x = p[torch.isfinite(p)].reshape(-1, 16 * 16).to(device)  # 255 x 256
    check_nvfp4(x[:240], spec)


@pytest.mark.parametrize("device", DEVICES)
def test_rht_all_finite_bf16_patterns(device):
    # RHT runs go along dim 0: each column holds 16 consecutive patterns, whose magnitudes span
    # far less than 2**45, where the fp64 sum of the reference and of the kernels is exact.
    p = all_bf16_patterns()
    x = p[torch.isfinite(p)].reshape(-1, 16).t().contiguous().to(device)  # [16, 4080]
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True))
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True, stochastic_rounding=True), SRSeed(5, 9))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("share", [0.01, 0.3, 1.0])
def test_rht_runs_past_the_fp32_range(device, share):
    # Runs whose magnitudes span more than 2**12 cannot take the fp32 butterfly; the CUDA kernels
    # send them through fp64 over half-warps, two runs a round. A share of the columns holds such
    # runs (a few a warp, most of them, or all: rounds with both runs of a lane, and odd counts),
    # the rest Gaussian ones. Wide runs mix magnitudes 2**-40 .. 2**40 and subnormals, where even
    # the fp64 sums round: the kernels' fp64 butterfly takes the reference's operations in its
    # order, so they round alike.
    g = torch.Generator().manual_seed(int(share * 100))
    x = torch.randn(256, 512, generator=g)
    wide = torch.rand(512, generator=g) < share
    mags = torch.exp2(torch.randint(-40, 41, (256, 512), generator=g).float())
    tiny = torch.rand(256, 512, generator=g) < 0.05
    spread = torch.where(tiny, x * 2.0**-130, x * mags)
    x = torch.where(wide, spread, x).bfloat16().to(device)
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True))
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True, stochastic_rounding=True), SRSeed(7, 0))


def runs_near_bf16_ties(seed: int, rows: int = 256, cols: int = 128) -> torch.Tensor:
    """bf16 [rows, cols] whose 16-runs down each column hold 2**t and +-2**(t - 8), so that their
    transforms sit on a bf16 half-way point (1 + 2**-8), or on a representable value, scaled; the
    other 14 elements are tiny and decide the rounding: near the sums' last fp32 bit (2**(t - 28)
    .. 2**(t - 17), where the fp32 butterfly rounds them) or far below it (down to 2**(t - 90))."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows // 16, 16, cols)

    def signs(*size):
        return torch.randint(0, 2, size, generator=g).double() * 2 - 1

    t = torch.randint(-10, 10, (rows // 16, 1, cols), generator=g).double()
    near = torch.randint(17, 29, shape, generator=g)
    far = torch.randint(30, 91, shape, generator=g)
    drop = torch.where(torch.rand(shape, generator=g) < 0.5, near, far).double()
    mant = 1 + torch.randint(0, 128, shape, generator=g).double() / 128
    runs = signs(*shape) * mant * torch.exp2(t - drop)
    runs[:, :1] = signs(rows // 16, 1, cols) * torch.exp2(t)
    i1 = torch.randint(1, 16, (rows // 16, 1, cols), generator=g)
    runs.scatter_(1, i1, signs(rows // 16, 1, cols) * torch.exp2(t - 8))
    x = runs.reshape(rows, cols)
    assert torch.equal(x.bfloat16().double(), x)
    return x.bfloat16()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rht_sums_near_bf16_ties(device, seed):
    # The CUDA kernels keep an fp32 butterfly's result of a run outside the fp32 range where its
    # error bound pins the bf16 rounding, and send the run through fp64 where a result may round
    # either way: here most runs have a result on a half-way point up to their tiny elements.
    # Codes, scales, the amax after RHT and its per-column form.
    x = runs_near_bf16_ties(seed).to(device)
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True))
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True, stochastic_rounding=True), SRSeed(seed, 3))
    check_nvfp4(x, NVFP4Spec(rht=True, columnwise=True, block_2d=True))
    ref = apply_rht(x.cpu().t().contiguous()).float().abs().amax(dim=1)
    got = Q.amax(x, columnwise=True, rht=True, per_row=True)
    assert_bits_equal(got.cpu(), ref, "per-column amax after RHT")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [NVFP4Spec(rht=True, columnwise=True, block_2d=True),
                                  NVFP4Spec(rht=True, columnwise=True, block_2d=True, stochastic_rounding=True)],
                         ids=str)
def test_rht_2d_tiles_beside_a_huge_run(device, spec):
    # The CUDA kernels keep a run whose fp32 sums are exact as 4 x its transform and fold the
    # quarter into the block factor. A 2D tile shares its scale with a run of 2**125 (through fp64:
    # its exponent is past the fp32 range), whose transform 2**127 is the tensor amax, so the
    # factor 6 / 2**127 of the tile's ordinary runs has no exact quarter: they fall back to
    # their own scale. Every column of a tile holds ordinary runs but the first.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    x[16:32, 0] = signs * 2.0**125
    x[32:48, 16:32] = signs[:, None] * 2.0**125  # a whole tile of them
    x = x.bfloat16().to(device)
    sr = SRSeed(3, 0) if spec.stochastic_rounding else None
    check_nvfp4(x, spec, sr)
    ref = nvfp4.quantize(x, spec, sr)
    assert float(ref.amax) == 2.0**127


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [[float("inf")], [float("inf"), -float("inf")], [float("nan")]],
                         ids=["inf", "inf_and_minus_inf", "nan"])
def test_amax_after_rht_of_non_finite_runs(device, bad):
    # A run with inf goes through fp64 (its exponent is past the fp32 range): its transform holds
    # inf, or NaN where inf meets -inf in the butterfly; the amax is then inf or NaN.
    g = torch.Generator().manual_seed(len(bad))
    x = torch.randn(320, 192, generator=g)
    for i, b in enumerate(bad):
        x[35 + 3 * i, 70] = b
    x = x.bfloat16()
    ref = nvfp4.quantize(x, NVFP4Spec(rht=True, columnwise=True)).amax
    got = Q.amax(x.to(device), columnwise=True, rht=True)
    assert_bits_equal_nan(got.cpu(), ref, f"amax after RHT with {bad}")
    assert not torch.isfinite(ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columnwise,rht,per_row", [
    (False, False, False), (False, False, True), (True, False, False), (True, False, True),
    (True, True, False), (True, True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_amax_does_not_read_its_output_memory(device, columnwise, rht, per_row, dtype):
    # The amax's output starts from its own initialisation, not from what its memory held: the
    # caching allocator hands out a block just freed, so that block is first filled with a value
    # above every |x| (and NaN, which atomic maxima of the bits would keep).
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(96, 160, generator=g) * 3).to(dtype)
    xt = x.float().t() if columnwise else x.float()
    if rht:
        xt = apply_rht(x.t().contiguous()).float()
    want = xt.abs().amax(dim=1) if per_row else xt.abs().amax()
    for poison in (1e30, float("nan")):
        for _ in range(3):
            junk = torch.full(want.shape, poison, device=device)
            del junk
            got = Q.amax(x.to(device), columnwise=columnwise, rht=rht, per_row=per_row)
            what = f"amax {columnwise=} {rht=} {per_row=} after {poison}"
            assert_bits_equal(got.cpu(), want, what)


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("rht", [False, True], ids=["plain", "after_rht"])
def test_amax_of_many_ctas_finds_one_element(device, rht):
    # Each CTA of the amax kernels joins its warps' maxima before its one atomic. One element
    # above all others, or a NaN, is the amax wherever it lies: the first and the last element,
    # one in the middle, and one in the last warp of an early CTA of the streaming kernel, which
    # walks the 16-byte words from the last: word 5 * 256 + 250 from the end, element 8 * (2**21
    # - 1531) = (8186, 40); its mirror (5, 1990) as well. 8192 x 2048 bf16 is more than one round
    # of either persistent grid.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8192, 2048, generator=g).bfloat16()
    for r, c in [(0, 0), (4097, 1000), (8191, 2047), (8186, 40), (5, 1990)]:
        for value in (1e4, float("nan")):
            y = x.clone()
            y[r, c] = value
            want = (apply_rht(y.t().contiguous()) if rht else y).float().abs().amax()
            got = Q.amax(y.to(device), columnwise=rht, rht=rht)
            assert_bits_equal_nan(got.cpu(), want, f"amax {rht=} with {value} at ({r}, {c})")


SR_SPECS = [NVFP4Spec(stochastic_rounding=True), NVFP4Spec(columnwise=True, stochastic_rounding=True),
            NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SR_SPECS, ids=str)
@pytest.mark.parametrize("offset", [0, 9, 2**32 - 4096])
def test_stochastic_rounding_all_finite_bf16_patterns(device, spec, offset):
    # The tile kernel hashes a block's 16 counters in fewer steps when the first is a multiple of
    # 16 (offsets 0 and 2**32 - 4096, where the counters wrap inside the tensor) and the general
    # way otherwise (offset 9). The patterns span the whole bf16 range, so small blocks under the
    # huge global amax get scale 0 and products that overflow to inf.
    p = all_bf16_patterns()
    finite = p[torch.isfinite(p)]
    if spec.rht:  # 16-runs down the columns, as in test_rht_all_finite_bf16_patterns
        x = finite.reshape(-1, 16).t().contiguous()
    else:
        x = finite.reshape(-1, 16 * 16)[:240]
    check_nvfp4(x.to(device), spec, SRSeed(11, offset))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_all_bf16_patterns(device, rule):
    x = all_bf16_patterns().reshape(2048, 32).to(device)
    for columnwise in (False, True):
        ref = mxfp8.quantize(x, MXFP8Spec(rule, columnwise))
        rq, rs, cq, cs = Q.mxfp8_both(x, rule, not columnwise, columnwise)
        q, s = (cq, cs) if columnwise else (rq, rs)
        assert_bytes_equal(s, ref.scale, f"mxfp8 {rule} col={columnwise} scale")
        assert_bytes_equal(canon_nan(q), canon_nan(ref.qdata), f"mxfp8 {rule} col={columnwise} data")


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_all_bf16_patterns_and_fp32(device):
    x = all_bf16_patterns().reshape(2048, 32).to(device)
    assert_bits_equal_nan(Q.fake_quantize_mxfp4(x), mxfp4.fake_quantize_values(x), "mxfp4 bf16")
    w = torch.randn(96, 64, device=device) * torch.logspace(-30, 30, 64, device=device)
    assert_bits_equal(Q.fake_quantize_mxfp4(w), mxfp4.fake_quantize_values(w), "mxfp4 fp32")


# ---- every option, random shapes, layouts ----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_nvfp4_every_option(device, dtype):
    g = torch.Generator().manual_seed(7)
    for i, spec in enumerate(SPECS):
        # Shapes that exercise partial 64x64 tiles; rowwise 1D also rows not divisible by 16.
        rows = (16, 48, 80, 112)[i % 4] + (0 if (spec.columnwise or spec.block_2d) else i % 3)
        cols = (32, 96, 144)[i % 3]
        x = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 40).to(dtype)
        check_nvfp4(x.to(device), spec, SRSeed(i, 3 * i) if spec.stochastic_rounding else None)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_views_3d_zeros_outliers(device):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 160, generator=g).bfloat16().to(device)
    flat = torch.randn(64 * 64 + 8, generator=g).bfloat16().to(device)
    cases = {
        "non-contiguous columns": base[:, 16:144],
        "transposed view": base[:, :64].t(),
        "misaligned offset": flat[8:].view(64, 64),
        "3-D": base.reshape(4, 16, 160),
        "all zero": torch.zeros(32, 64, dtype=torch.bfloat16, device=device),
        "outlier": base.clone().index_put_((torch.tensor([5], device=device),) * 2,
                                           torch.tensor(3e38, dtype=torch.bfloat16, device=device)),
    }
    for name, x in cases.items():
        for spec in (NVFP4Spec(), NVFP4Spec(columnwise=True), NVFP4Spec(row_scaled=True),
                     NVFP4Spec(block_2d=True), NVFP4Spec(fourover6="mae", e4m3_bound=256)):
            if spec.columnwise and x.dim() != 2:
                continue
            check_nvfp4(x, spec)
    z = Q.quantize_nvfp4(cases["all zero"], NVFP4Spec())[0]
    out = Q.dequantize_nvfp4(z.qdata, z.scale, z.amax, 448)
    assert torch.equal(out, torch.zeros_like(out)), "all-zero input must decode to zeros"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tile_kernels_read_their_own_input_in_recycled_memory(device, dtype):
    # Inputs of other shapes one after another in the memory the previous one freed: each cast
    # reads its own input (the CUDA tile kernels keep their inputs' tensor maps by address, sizes
    # and box), both NVFP4 tiles (128 x 64) and MXFP8 ones (64 x 128).
    g = torch.Generator().manual_seed(13)
    for shape in ((256, 128), (128, 256), (512, 64), (64, 512), (256, 128), (192, 160)):
        x = (torch.randn(shape, generator=g) * 7).to(dtype).to(device)
        for spec in (NVFP4Spec(columnwise=True), NVFP4Spec(block_2d=True)):
            check_nvfp4(x, spec)
        col = mxfp8.quantize(x, MXFP8Spec(columnwise=True))
        got = Q.mxfp8_both(x, "rceil", False, True)
        assert_bytes_equal(got[2], col.qdata, f"mx col {shape} {dtype}")
        assert_bytes_equal(got[3], col.scale, f"mx col scale {shape} {dtype}")
        del x, got


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_shapes_and_dtypes(device):
    g = torch.Generator().manual_seed(11)
    for shape, dtype in (((64, 96), torch.float32), ((3, 32, 64), torch.bfloat16),
                         ((96, 64), torch.float16), ((160, 224), torch.bfloat16)):
        x = (torch.randn(shape, generator=g) * 100).to(dtype).to(device)
        for rule in ("rceil", "floor"):
            row = mxfp8.quantize(x, MXFP8Spec(rule))
            got = Q.mxfp8_both(x, rule, True, x.dim() == 2 and shape[0] % 32 == 0)
            assert_bytes_equal(got[0], row.qdata, f"mx row {shape}")
            assert_bytes_equal(got[1], row.scale, f"mx row scale {shape}")
            if got[2].numel():
                col = mxfp8.quantize(x, MXFP8Spec(rule, columnwise=True))
                assert_bytes_equal(got[2], col.qdata, f"mx col {shape}")
                assert_bytes_equal(got[3], col.scale, f"mx col scale {shape}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp8_columnwise_partial_tiles_and_special_blocks(device, dtype):
    # Widths that end inside a tile (in a 32-column half and inside an 8-column group's
    # neighbours), several tiles of rows, and NaN / inf / zero blocks next to finite ones in the
    # same 32x32 patch: a NaN or inf block's bytes are 0x7F, its neighbours' are not.
    g = torch.Generator().manual_seed(5)
    big = 3e4 if dtype == torch.float16 else 3e37
    for rows, cols in ((96, 48), (64, 80), (160, 144), (256, 64)):
        x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 13, (rows, cols), generator=g).float())
        x[3, 5] = float("nan")                 # column 5 of rows 0..31: one NaN block
        x[40, 9] = float("inf")                # column 9 of rows 32..63
        x[33, 10] = -big                       # a large finite neighbour of that inf column
        x[64:96, 12] = 0                       # an all-zero column block
        x[rows - 26, :32] = float("-inf")      # one row block of inf (rowwise), many columns
        x = x.to(dtype).to(device)
        for rule in ("rceil", "floor"):
            col = mxfp8.quantize(x, MXFP8Spec(rule, columnwise=True))
            _, _, cq, cs = Q.mxfp8_both(x, rule, False, True)
            what = f"{rule} {dtype} {rows}x{cols}"
            assert_bytes_equal(cs, col.scale, f"mx col scale {what}")
            assert_bytes_equal(canon_nan(cq), canon_nan(col.qdata), f"mx col {what}")
            if cols % 32 == 0:
                row = mxfp8.quantize(x, MXFP8Spec(rule))
                rq, rs, cq2, cs2 = Q.mxfp8_both(x, rule, True, True)
                assert_bytes_equal(rs, row.scale, f"mx both row scale {what}")
                assert_bytes_equal(canon_nan(rq), canon_nan(row.qdata), f"mx both row {what}")
                assert_bytes_equal(cs2, col.scale, f"mx both col scale {what}")
                assert_bytes_equal(canon_nan(cq2), canon_nan(col.qdata), f"mx both col {what}")


def test_mxfp8_columnwise_odd_width_cpu():
    # The CPU columnwise kernel converts 16 columns at a time and the rest one by one: widths
    # 17 and 40 leave 1 and 8 columns to that tail.
    g = torch.Generator().manual_seed(12)
    for cols in (17, 40):
        x = (torch.randn(64, cols, generator=g) * torch.logspace(-20, 20, cols)).bfloat16()
        for rule in ("rceil", "floor"):
            got = Q.mxfp8_both(x, rule, False, True)
            col = mxfp8.quantize(x, MXFP8Spec(rule, columnwise=True))
            assert_bytes_equal(got[2], col.qdata, f"mx col width {cols}")
            assert_bytes_equal(got[3], col.scale, f"mx col scale width {cols}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [
    NVFP4Spec(columnwise=True), NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True),
    NVFP4Spec(columnwise=True, fourover6="mse", e4m3_bound=256),
], ids=str)
def test_hybrid_gradient_cast(device, spec):
    g = torch.randn(96, 160, generator=torch.Generator().manual_seed(2)).bfloat16().to(device) * 1e-3
    mx, nv, _ = Q.quantize_hybrid_grad(g, "rceil", spec, SRSeed(17, 4))
    ref_mx = mxfp8.quantize(g, MXFP8Spec("rceil"))
    ref_nv = nvfp4.quantize(g, spec, SRSeed(17, 4))
    assert_bytes_equal(mx.qdata, ref_mx.qdata, "hybrid mxfp8 data")
    assert_bytes_equal(mx.scale, ref_mx.scale, "hybrid mxfp8 scale")
    assert_bytes_equal(nv.qdata, ref_nv.qdata, "hybrid nvfp4 codes")
    assert_bytes_equal(nv.scale, ref_nv.scale, "hybrid nvfp4 scale")


# ---- the tile kernel on many tiles ------------------------------------------------------------------

# The modes that run in the tile kernel (csrc/quant_cuda.cu): columnwise, 2D, rowwise with
# stochastic rounding. 1056 x 800 is 9 x 13 tiles of 128 x 64, the last of each ragged: fewer
# than a GPU holds CTAs, so each CTA takes one (test_tile_kernel_walks_many_tiles_a_cta gives
# them several).
TILE_SPECS = [s for s in SPECS if s.columnwise or s.block_2d or s.stochastic_rounding]


def spread_input(shape, dtype, seed):
    """Values over 2**-e .. 2**e within every 16-run (RHT then takes both its exact fp32 and its
    fp64 butterfly), some all-zero rows and columns, and one outlier."""
    g = torch.Generator().manual_seed(seed)
    e = 10 if dtype == torch.float16 else 24
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-e, e + 1, shape, generator=g).float())
    x[16:32] = 0
    x[:, 48:64] = 0
    x[100, 200] = 3e4
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tile_kernel_many_tiles(device, dtype):
    x = spread_input((1056, 800), dtype, 21).to(device)
    narrow = (torch.randn(1056, 800, generator=torch.Generator().manual_seed(22)) * 3).to(dtype).to(device)
    for i, spec in enumerate(TILE_SPECS):
        sr = SRSeed(i, 7 * i) if spec.stochastic_rounding else None
        check_nvfp4(x, spec, sr)
        check_nvfp4(narrow, spec, sr)
    for rule in ("rceil", "floor"):
        rq, rs, cq, cs = Q.mxfp8_both(x, rule, True, True)
        row, col = mxfp8.quantize(x, MXFP8Spec(rule)), mxfp8.quantize(x, MXFP8Spec(rule, columnwise=True))
        assert_bytes_equal(rq, row.qdata, f"mx row {rule}")
        assert_bytes_equal(rs, row.scale, f"mx row scale {rule}")
        assert_bytes_equal(cq, col.qdata, f"mx col {rule}")
        assert_bytes_equal(cs, col.scale, f"mx col scale {rule}")
        _, _, cq1, cs1 = Q.mxfp8_both(x, rule, False, True)
        assert_bytes_equal(cq1, col.qdata, f"mx col alone {rule}")
        assert_bytes_equal(cs1, col.scale, f"mx col alone scale {rule}")


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tile_kernel_walks_many_tiles_a_cta(device, dtype):
    # The tile kernel's persistent CTAs walk their tiles through a ring of 3 stages (4 for the
    # bf16 hybrid cast without RHT), refilling the stage of the tile before: 16384 x 2048 is
    # 4096 tiles of either shape (128 x 64 NVFP4, 64 x 128 MXFP8), 7 or more a CTA on a GPU of
    # 132 SMs, so every stage is refilled and its barrier's phase wraps. Every kernel family:
    # NVFP4 columnwise (plain, 2D, RHT + SR), 2D rowwise with 4over6 (the rows kernel), rowwise
    # with SR, MXFP8 columnwise and both, and both forms of the hybrid cast.
    x = spread_input((16384, 2048), dtype, 41).to(device)
    specs = [NVFP4Spec(columnwise=True), NVFP4Spec(block_2d=True, columnwise=True),
             NVFP4Spec(stochastic_rounding=True),
             NVFP4Spec(block_2d=True, fourover6="mse", e4m3_bound=256)]
    if dtype == torch.bfloat16:
        specs.append(NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True))
    for i, spec in enumerate(specs):
        check_nvfp4(x, spec, SRSeed(i, 16 * i) if spec.stochastic_rounding else None)
    rq, rs, cq, cs = Q.mxfp8_both(x, "rceil", True, True)
    row = mxfp8.quantize(x, MXFP8Spec("rceil"))
    col = mxfp8.quantize(x, MXFP8Spec("rceil", columnwise=True))
    for got, want, what in ((rq, row.qdata, "row"), (rs, row.scale, "row scale"),
                            (cq, col.qdata, "col"), (cs, col.scale, "col scale")):
        assert_bytes_equal(got, want, f"mx {what}")
    _, _, cq1, cs1 = Q.mxfp8_both(x, "rceil", False, True)
    assert_bytes_equal(cq1, col.qdata, "mx col alone")
    assert_bytes_equal(cs1, col.scale, "mx col alone scale")
    if dtype == torch.bfloat16:
        rht_sr = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
        for spec, sr in ((NVFP4Spec(columnwise=True), None), (rht_sr, SRSeed(9, 0))):
            mx, nv, _ = Q.quantize_hybrid_grad(x, "rceil", spec, sr)
            assert_bytes_equal(mx.qdata, row.qdata, f"hybrid mxfp8 data {spec}")
            assert_bytes_equal(mx.scale, row.scale, f"hybrid mxfp8 scale {spec}")
            ref_nv = nvfp4.quantize(x, spec, sr)
            assert_bytes_equal(nv.qdata, ref_nv.qdata, f"hybrid nvfp4 codes {spec}")
            assert_bytes_equal(nv.scale, ref_nv.scale, f"hybrid nvfp4 scale {spec}")


def poison_blocks(tensors):
    """Blocks of the caching allocator of each tensor's size, filled with 0xFF and freed: the next
    outputs of those sizes start as 0xFF, so bytes a kernel leaves unwritten show."""
    blocks = [torch.full((t.numel() * t.element_size(),), 0xFF, dtype=torch.uint8, device=t.device) for t in tensors]
    del blocks


@pytest.mark.parametrize("device", DEVICES[1:])
def test_tile_walk_takes_every_unit_once(device):
    # Where the tile kernel's CTAs walk more than one unit each, they take each next unit from a
    # counter as they go, on inputs of 2**26 elements or more (2**27 for the NVFP4 columnwise
    # casts alone; launch_walk): every tile must be quantized by one CTA. Each cast's outputs come
    # from blocks just filled with 0xFF, so a tile no CTA took shows (outputs of an earlier cast of
    # the same bytes would hide it). 16384 x 8192 is 16384 tiles: 8192 pairs or 4096 strips or
    # quads, several for each CTA a GPU of 132 SMs holds.
    x = spread_input((16384, 8192), torch.bfloat16, 43).to(device)
    ref_mx = mxfp8.quantize(x, MXFP8Spec("rceil"))
    ref_mxc = mxfp8.quantize(x, MXFP8Spec("rceil", columnwise=True))
    rht_sr = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    for spec, sr in ((NVFP4Spec(columnwise=True), None), (rht_sr, SRSeed(4, 0))):
        ref = nvfp4.quantize(x, spec, sr)
        for walk in (2, 4):
            poison_blocks((ref.qdata, ref.scale))
            q, sc = nvfp4_cast(x, spec, sr, walk)
            assert_bytes_equal(q, ref.qdata, f"codes {spec} walk {walk}")
            assert_bytes_equal(sc, ref.scale, f"scale {spec} walk {walk}")
            poison_blocks((ref_mx.qdata, ref_mx.scale, ref.qdata, ref.scale))
            got = hybrid_cast(x, spec, sr, walk)
            for g, w, what in zip(got, (ref_mx.qdata, ref_mx.scale, ref.qdata, ref.scale),
                                  ("mxfp8 data", "mxfp8 scale", "nvfp4 codes", "nvfp4 scale")):
                assert_bytes_equal(g, w, f"hybrid {what} {spec} walk {walk}")
    poison_blocks((ref_mx.qdata, ref_mx.scale, ref_mxc.qdata, ref_mxc.scale))
    got = Q.mxfp8_both(x, "rceil", True, True)
    for g, w, what in zip(got, (ref_mx.qdata, ref_mx.scale, ref_mxc.qdata, ref_mxc.scale),
                          ("row", "row scale", "col", "col scale")):
        assert_bytes_equal(g, w, f"mx both {what}")


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("spec", [NVFP4Spec(fourover6="mae"), NVFP4Spec(fourover6="mse", e4m3_bound=256)], ids=str)
def test_fourover6_rows_persistent_grid(device, spec):
    # The rowwise 4over6 kernel is a persistent grid whose CTAs each build one table of the 256
    # scale bytes and walk many chunks of 512 blocks: 4.7M elements are more chunks than an H200
    # holds CTAs. Both candidates must win often, or the comparison proves little.
    x = spread_input((2304, 2048), torch.bfloat16, 31)
    x[:, 1024:] = torch.randn(2304, 1024, generator=torch.Generator().manual_seed(32)).bfloat16()
    x = x.to(device)
    check_nvfp4(x, spec)
    chosen = nvfp4.quantize(x, spec).scale.float()
    six = nvfp4.quantize(x, NVFP4Spec(e4m3_bound=spec.e4m3_bound)).scale.float()
    map4 = (chosen != six).float().mean().item()
    assert 0.05 < map4 < 0.95, f"map-to-4 blocks: {map4:.3f} of all"


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("spec", [NVFP4Spec(block_2d=True),
                                  NVFP4Spec(fourover6="mae", block_2d=True),
                                  NVFP4Spec(fourover6="mse", block_2d=True, e4m3_bound=256)],
                         ids=str)
def test_2d_rows_many_panels(device, spec):
    # The 2D rowwise kernels take a panel of 16 rows x 128 columns a warp, 4over6's in a
    # persistent grid: 16384 x 2000 is 16384 panels, more than a GPU holds warps, and its last
    # panel column has 80 columns (lanes with no tile). Both 4over6 candidates must win
    # thousands of tiles.
    x = spread_input((16384, 2000), torch.bfloat16, 33)
    x[:, 1024:] = torch.randn(16384, 976, generator=torch.Generator().manual_seed(34)).bfloat16()
    x = x.to(device)
    check_nvfp4(x, spec)
    if spec.fourover6:
        chosen = nvfp4.quantize(x, spec).scale.float()
        six = nvfp4.quantize(x, NVFP4Spec(block_2d=True, e4m3_bound=spec.e4m3_bound)).scale.float()
        map4 = (chosen != six).float().mean().item()
        assert 0.02 < map4 < 0.98, f"map-to-4 tiles: {map4:.3f} of all"


def assert_walks_match(cast, x, cases, walks, reference):
    """Each (spec, sr) case cast by `cast(x, spec, sr, walk)` at every walk in `walks` gives the
    bytes of `reference(spec, sr)`, a dict of the outputs in the op's order by name."""
    for spec, sr in cases:
        want = reference(spec, sr)
        for walk in walks:
            got = cast(x, spec, sr, walk)
            assert len(got) == len(want), f"{len(got)} outputs, {len(want)} references"
            for (name, w), g in zip(want.items(), got):
                assert_bytes_equal(g, w, f"{name} {spec} {sr} walk {walk}")


def hybrid_cast(x, spec, sr, walk):
    """The hybrid cast's four outputs by the op, its CUDA tile walk forced to `walk` (0: chosen)."""
    state = sr_state_tensor(sr, x.device) if sr is not None else None
    a = Q.amax(x, columnwise=True, rht=spec.rht)
    return torch.ops.qtensor.hybrid_quantize.default(
        x, a, 0, 0, spec.e4m3_bound, spec.rht, spec.stochastic_rounding, state, walk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1056, 800), (1024, 864), (1040, 2080)], ids=str)
def test_hybrid_cast_many_tiles(device, dtype, shape):
    # The CUDA hybrid cast walks its 128 x 64 tiles by pairs (two tile rows) or, for 16-bit
    # inputs, by quads (two tile rows x two tile columns): each walk is forced here, and the
    # choice (walk 0) taken too. 1056 x 800 is 9 x 13 tiles, the last of each ragged (units with
    # tiles past both edges, a last column of 32); 1024 x 864 is 8 x 14 (whole quads but for a
    # last column of 32); 1040 x 2080 has a last tile row of 16 and a last column of 32 whose row
    # scales are one byte of a quad's four.
    x = spread_input(shape, dtype, 23).to(device)
    rht_sr = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    # Offsets 1 and 32: the stochastic codes' general hash and their block hash (a multiple of 16).
    cases = ((NVFP4Spec(columnwise=True), None), (rht_sr, SRSeed(3, 1)), (rht_sr, SRSeed(3, 32)))
    walks = (0, 2, 4) if dtype != torch.float32 else (0, 2)
    ref_mx = mxfp8.quantize(x, MXFP8Spec("rceil"))

    def reference(spec, sr):
        ref_nv = nvfp4.quantize(x, spec, sr)
        return {"hybrid mxfp8 data": ref_mx.qdata, "hybrid mxfp8 scale": ref_mx.scale,
                "hybrid nvfp4 codes": ref_nv.qdata, "hybrid nvfp4 scale": ref_nv.scale}

    assert_walks_match(hybrid_cast, x, cases, walks, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_cast_walk_errors_name_the_rule(device):
    x = torch.randn(128, 64).bfloat16().to(device)
    spec = NVFP4Spec(columnwise=True)
    with pytest.raises(RuntimeError, match="walk 0 .chosen., 2 .pairs. or 4 .quads.; got 3"):
        hybrid_cast(x, spec, None, 3)
    if device != "cpu":
        with pytest.raises(RuntimeError, match="quads of 16-bit inputs only; got Float"):
            hybrid_cast(x.float(), spec, None, 4)
    # With 4over6 the cast is two casts of their own walks: a forced walk is refused, not ignored.
    a = Q.amax(x, columnwise=True, rht=False)
    for walk in (2, 4):
        with pytest.raises(RuntimeError, match=f"takes no tile walk; got walk {walk} with fourover6 1. Pass walk 0"):
            torch.ops.qtensor.hybrid_quantize.default(x, a, 0, 1, 448, False, False, None, walk)


def nvfp4_cast(x, spec, sr, walk):
    """NVFP4 codes and scales by the op, its CUDA columnwise tile walk forced to `walk` (0: chosen)."""
    state = sr_state_tensor(sr, x.device) if sr is not None else None
    a = Q.amax(x, columnwise=spec.columnwise, rht=spec.rht)
    return torch.ops.qtensor.nvfp4_quantize.default(
        x, a, spec.columnwise, spec.block_2d, 0, spec.e4m3_bound, spec.rht, spec.stochastic_rounding, state, walk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1056, 800), (1664, 224), (2432, 2080), (2048, 256)], ids=str)
def test_nvfp4_columnwise_walks(device, shape):
    # The bf16 NVFP4 columnwise casts of their own kernel walk 128 x 64 tiles by pairs of tile rows
    # or by strips of four, whose second pair stores both pairs' scale bytes (32 a result row):
    # each walk is forced here, and the choice (walk 0) taken too. 1056 x 800 is 9 tile rows (a
    # last strip of one tile row, 32 rows of it in) and a last column of 32; 1664 x 224 is 13 tile
    # rows (a last strip of one) and 3.5 tile columns; 2432 x 2080 is 19 (a last strip of three:
    # its second pair half in); 2048 x 256 is whole strips, whose rows' 32 scale bytes are aligned
    # sectors (M % 512 == 0).
    x = spread_input(shape, torch.bfloat16, 29).to(device)
    rht_sr = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    # Offsets 1 and 32: the stochastic codes' general hash and their block hash (a multiple of 16).
    cases = ((NVFP4Spec(columnwise=True), None), (NVFP4Spec(columnwise=True, block_2d=True), None),
             (rht_sr, SRSeed(5, 1)), (rht_sr, SRSeed(5, 32)))

    def reference(spec, sr):
        ref = nvfp4.quantize(x, spec, sr)
        return {"nvfp4 codes": ref.qdata, "nvfp4 scale": ref.scale}

    assert_walks_match(nvfp4_cast, x, cases, (0, 2, 4), reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1024, 64), (512, 128)], ids=str)
def test_walks_all_finite_bf16_patterns(device, shape):
    # Every finite bf16 pattern (and the first 256 again, to fill 65,536) through each walk of
    # the NVFP4 columnwise casts (pairs, strips of four tile rows) and of the hybrid cast (pairs,
    # quads): 1024 x 64 is two whole strips in one tile column (quads without their second
    # column), 512 x 128 one strip and one whole quad column. Down a column, an RHT run's 16 rows
    # hold patterns 64 or 128 apart, spans of about 2**8 or 2**15 in magnitude, and far more
    # across the sign boundary (the largest positive patterns beside -0 and the negative
    # subnormals): they take the fp32 butterfly or, past the kernels' range test, the fp64 one.
    p = all_bf16_patterns()
    finite = p[torch.isfinite(p)]
    x = torch.cat([finite, finite[:256]]).reshape(shape).to(device)
    rht_sr = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    cases = ((NVFP4Spec(columnwise=True), None), (NVFP4Spec(columnwise=True, block_2d=True), None),
             (rht_sr, SRSeed(7, 32)))
    ref_mx = mxfp8.quantize(x, MXFP8Spec("rceil"))

    def nv_reference(spec, sr):
        ref = nvfp4.quantize(x, spec, sr)
        return {"nvfp4 codes": ref.qdata, "nvfp4 scale": ref.scale}

    def hybrid_reference(spec, sr):
        ref_nv = nvfp4.quantize(x, spec, sr)
        return {"hybrid mxfp8 data": ref_mx.qdata, "hybrid mxfp8 scale": ref_mx.scale,
                "hybrid nvfp4 codes": ref_nv.qdata, "hybrid nvfp4 scale": ref_nv.scale}

    assert_walks_match(nvfp4_cast, x, cases, (0, 2, 4), nv_reference)
    assert_walks_match(hybrid_cast, x, (cases[0], cases[2]), (0, 2, 4), hybrid_reference)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_walk_errors_name_the_rule(device):
    x = torch.randn(128, 64).bfloat16().to(device)
    col = NVFP4Spec(columnwise=True)
    with pytest.raises(RuntimeError, match="walk 0 .chosen., 2 .pairs. or 4 .strips.; got 3"):
        nvfp4_cast(x, col, None, 3)
    if device != "cpu":
        with pytest.raises(RuntimeError, match="walk 2 is a columnwise tile walk; the rowwise cast has none"):
            nvfp4_cast(x, NVFP4Spec(), None, 2)
        with pytest.raises(RuntimeError, match="strips in the bf16 columnwise casts .* got Float"):
            nvfp4_cast(x.float(), col, None, 4)
        with pytest.raises(RuntimeError, match="strips in the bf16 columnwise casts .* rht true, stochastic false"):
            nvfp4_cast(x, NVFP4Spec(columnwise=True, rht=True), None, 4)


# ---- stochastic rounding -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_seed_offset(device):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(device)
    spec = NVFP4Spec(columnwise=True, stochastic_rounding=True)
    a = kernel_nvfp4(x, spec, SRSeed(1, 0))[0]
    assert torch.equal(a, kernel_nvfp4(x, spec, SRSeed(1, 0))[0]), "same seed, same bytes"
    assert not torch.equal(a, kernel_nvfp4(x, spec, SRSeed(2, 0))[0]), "another seed differs"
    assert not torch.equal(a, kernel_nvfp4(x, spec, SRSeed(1, 1))[0]), "another offset differs"
    if device == "cuda":  # the same bytes as the CPU kernels
        assert torch.equal(a.cpu(), kernel_nvfp4(x.cpu(), spec, SRSeed(1, 0))[0])


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_statistics(device):
    # Constant blocks that sit between two grid points: the mean of the decoded values must match
    # the input (unbiased) and every code must be one of the two neighbours.
    vals = torch.tensor([0.3, 1.2, 2.6, 4.9], device=device)
    blocks = vals.repeat_interleave(16).reshape(4, 16)
    blocks[:, 15] = 6.0  # block amax 6 = global amax: scale 448 and enc 1, codes see the values
    x = blocks.reshape(64).repeat(4096, 1)
    spec = NVFP4Spec(stochastic_rounding=True)
    data, _ = Q.quantize_nvfp4(x, spec, SRSeed(123, 0))
    out = Q.dequantize_nvfp4(data.qdata, data.scale, data.amax, 448).reshape(4096, 4, 16)[..., :15]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=device)
    for j, v in enumerate(vals.tolist()):
        lo, hi = grid[grid <= v].max(), grid[grid >= v].min()
        got = out[:, j]
        assert bool(((got == lo) | (got == hi)).all()), f"{v}: only adjacent grid points"
        assert abs(got.double().mean().item() - v) < 0.01 * (hi - lo).item() + 1e-3, f"{v}: biased"


@pytest.mark.parametrize("device", DEVICES)
def test_state_tensor_rounds_like_its_seed(device):
    # The ops take (seed, offset) as an int64 tensor on the data's device; the kernel, the
    # reference given the tensor and the reference given the SRSeed must give the same bytes.
    x = (torch.randn(96, 160, generator=torch.Generator().manual_seed(5)) * 3).bfloat16().to(device)
    spec = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    state = torch.tensor([2**33 + 77, 2**32 + 40], device=device)  # only the low 32 bits count
    seed = SRSeed(77, 40)
    ref = nvfp4.quantize(x, spec, seed)
    for sr in (state, seed):
        assert_bytes_equal(nvfp4.quantize(x, spec, sr).qdata, ref.qdata, f"reference {sr}")
        assert_bytes_equal(kernel_nvfp4(x, spec, sr)[0], ref.qdata, f"kernel {sr}")
    _, nv, _ = Q.quantize_hybrid_grad(x, "rceil", spec, state)
    assert_bytes_equal(nv.qdata, ref.qdata, "hybrid kernel")
    with pytest.raises(ValueError, match="int64 tensor of 2 elements"):
        Q.quantize_nvfp4(x, spec, state.int())


@pytest.mark.parametrize("device", DEVICES)
def test_generator_is_one_seed_draw(device):
    # A torch.Generator becomes (one randint draw in [0, 2**31 - 1), offset 0), drawn once.
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(6)).to(device)
    spec = NVFP4Spec(stochastic_rounding=True)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=torch.Generator().manual_seed(9)))
    got, _ = Q.quantize_nvfp4(x, spec, torch.Generator().manual_seed(9))
    assert_bytes_equal(got.qdata, nvfp4.quantize(x, spec, SRSeed(seed, 0)).qdata, "codes")


# ---- dequantize, swizzle, MXFP4 gradient ----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_both_formats(device):
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(4)) * 5).to(device)
    for spec in (NVFP4Spec(), NVFP4Spec(row_scaled=True), NVFP4Spec(fourover6="mae", e4m3_bound=256)):
        d = nvfp4.quantize(x, spec)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert_bits_equal(
                Q.dequantize_nvfp4(d.qdata, d.scale, d.amax, spec.e4m3_bound, dtype),
                nvfp4.dequantize(d.qdata, d.scale, d.amax, spec.e4m3_bound, dtype), f"nv {spec}")
    for columnwise in (False, True):
        d = mxfp8.quantize(x, MXFP8Spec(columnwise=columnwise))
        for dtype in (torch.float32, torch.bfloat16):
            assert_bits_equal(Q.dequantize_mxfp8(d.qdata, d.scale, columnwise, dtype),
                              mxfp8.dequantize(d.qdata, d.scale, columnwise, dtype), "mx")


@pytest.mark.parametrize("device", DEVICES)
def test_swizzle_round_trip(device):
    g = torch.Generator().manual_seed(5)
    for rows, cols in ((1, 1), (128, 4), (200, 9), (300, 64)):
        s = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8).to(device)
        s = s.view(torch.float8_e4m3fn)
        sw = Q.swizzle_scale(s)
        assert_bytes_equal(sw, scale_layout.swizzle(s), f"swizzle {rows}x{cols}")
        assert_bytes_equal(Q.unswizzle_scale(sw, rows, cols), s, f"unswizzle {rows}x{cols}")


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_straight_through_gradient(device):
    w = torch.randn(32, 64, device=device, requires_grad=True)
    out = Q.fake_quantize_mxfp4(w)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert torch.equal(w.grad, grad)
