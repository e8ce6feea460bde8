"""MXFP4 projection against an independent fp64 oracle, raw bits.

The oracle below is written from docs/formats.md, "MXFP4 fake quantization", in float64
arithmetic without the project's code: block exponent as the smallest e with amax <= 6 * 2**e
(clamped to [-126, 125], -126 for amax below 2**-126), then round-to-nearest-even onto the E2M1
grid by distances, ties to the even code, saturating at 6. Non-finite blocks become NaN.
"""

from __future__ import annotations

import torch

from qtensor.formats import mxfp4
from qtensor.qat import convert

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
EVEN = torch.tensor([2, 1, 2, 1, 2, 1, 2, 1])  # codes 0, 2, 4, 6 win ties


def oracle(w: torch.Tensor) -> torch.Tensor:
    """fp64 projection of w [..., K] (any float dtype); NaN for non-finite blocks."""
    wd = w.double().reshape(-1, 32)
    amax = wd.abs().amax(-1)
    _, ex = torch.frexp(amax.nan_to_num(0.0, 0.0, 0.0))
    e0 = ex.double() - 1  # floor(log2 amax) for amax > 0
    e = e0 - 2 + (amax > 6 * torch.exp2(e0 - 2)).double()
    e = torch.where(amax < 2.0**-126, torch.full_like(e, -126.0), e).clamp(-126, 125)
    v = wd.abs() / torch.exp2(e)[:, None]
    d = (v[..., None] - GRID).abs()
    best = d.min(-1, keepdim=True).values
    idx = ((d == best) * EVEN).argmax(-1)
    out = torch.copysign(GRID[idx] * torch.exp2(e)[:, None], wd)
    bad = ~torch.isfinite(wd).all(-1, keepdim=True)
    return out.masked_fill(bad, float("nan")).reshape(w.shape)


def assert_bits_equal(got: torch.Tensor, want64: torch.Tensor) -> None:
    want = want64.to(got.dtype)
    int_dtype = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), f"NaN poisoning differs at {int((nan_g != nan_w).sum())}"
    gb, wb = got.view(int_dtype)[~nan_g], want.view(int_dtype)[~nan_w]
    bad = (gb != wb).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} elements differ, first {got[~nan_g][bad[:4, 0]]}"


def all_bf16() -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_all_bf16_patterns_sorted_and_shuffled():
    w = all_bf16().reshape(2048, 32)
    shuffled = w.flatten()[torch.randperm(65536, generator=torch.Generator().manual_seed(6))]
    for x in (w, shuffled.reshape(2048, 32)):
        got = convert.project(x)
        assert got.dtype == torch.bfloat16
        assert_bits_equal(got, oracle(x))
    assert torch.isnan(convert.project(w)).any()  # the NaN/Inf rows are in the corpus


def _block(vals, scale_exp=0, fill=0.0) -> torch.Tensor:
    b = torch.full((32,), fill, dtype=torch.float64)
    b[: len(vals)] = torch.tensor(vals, dtype=torch.float64)
    return b * 2.0**scale_exp


def fp32_edges() -> torch.Tensor:
    blocks = [
        _block([0.0, -0.0]),
        _block([-0.0] * 32, fill=-0.0),
    ]
    # Subnormal ladder: a block whose amax is 2**-k (k = 127..133), plus the 2**-128 tie.
    for k in range(127, 134):
        blocks.append(_block([2.0**-k, -(2.0**-k), 2.0**-k * 0.75]))
    blocks.append(_block([2.0**-127, 2.0**-128, -(2.0**-128), 3 * 2.0**-129]))
    # Every E2M1 midpoint and one fp32 ulp either side, in blocks pinned to e by a 6 * 2**e.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for e in (-126, -60, 0, 17, 125):
        vals = [6.0]
        for m in mids:
            up = torch.nextafter(torch.tensor(m, dtype=torch.float32), torch.tensor(10.0))
            dn = torch.nextafter(torch.tensor(m, dtype=torch.float32), torch.tensor(-10.0))
            vals += [m, -m, float(up), float(dn)]
        blocks.append(_block(vals[:32], e))
    # 1.5 * 2**k +- 1 ulp: the boundary where the block exponent steps up.
    for k in (-100, 0, 100):
        c = torch.tensor(1.5 * 2.0**k, dtype=torch.float32)
        for v in (torch.nextafter(c, c * 2), c, torch.nextafter(c, c * 0)):
            blocks.append(_block([float(v), 1.0 * 2.0**k, -0.3 * 2.0**k]))
    # Saturation: the cap 6 * 2**125 and beyond (e clamps at 125, values clamp at 6).
    fmax = torch.finfo(torch.float32).max
    blocks.append(_block([6.0 * 2.0**125, -(6.0 * 2.0**125), 5.0 * 2.0**125]))
    blocks.append(_block([fmax, -fmax, 7.0 * 2.0**125, 1.0 * 2.0**124]))
    # Non-finite blocks poison.
    for bad in (float("nan"), float("inf"), float("-inf")):
        blocks.append(_block([1.0, bad, -2.0]))
    return torch.stack(blocks).float()


def test_fp32_edges():
    w = fp32_edges()
    got = convert.project(w)
    assert got.dtype == torch.float32
    assert_bits_equal(got, oracle(w))


def test_fp32_bit_fuzz():
    g = torch.Generator().manual_seed(61)
    bits = torch.randint(-(2**31), 2**31 - 1, (512, 64), generator=g, dtype=torch.int64)
    w = bits.to(torch.int32).view(torch.float32)
    # Also narrow-exponent fuzz, where blocks mix a few binades (the usual weight shape).
    narrow = torch.randn(512, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (512, 1), generator=g))
    for x in (w, narrow):
        assert_bits_equal(convert.project(x), oracle(x))


def test_misaligned_view_and_ste():
    base = torch.randn(8, 96, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    view = base[:, 32:]  # offset, non-contiguous rows
    assert_bits_equal(convert.project(view), oracle(view))
    w = view.detach().clone().float().requires_grad_()
    g = torch.randn_like(w)
    mxfp4.fake_quantize(w).backward(g)
    assert torch.equal(w.grad, g)  # straight-through


def test_fp16_rejected():
    try:
        mxfp4.fake_quantize(torch.zeros(2, 32, dtype=torch.float16))
    except TypeError as err:
        assert "fp16" in str(err) and "bf16 or fp32" in str(err)
    else:
        raise AssertionError("fp16 weights must be rejected")
