"""MXFP4 fake quantization on all 65,536 bf16 bit patterns against an fp64 oracle written here,
from the definition (docs/formats.md, "MXFP4 fake quantization"), not from the bit tricks the
reference uses. Both the reference and the dispatching entry point (a C++/CUDA kernel where one
is built) are checked."""

from __future__ import annotations

import pytest
import torch

from conftest import E2M1_GRID, all_bf16_patterns, assert_bits_equal
from qtensor.formats import mxfp4
from qtensor.ops import quant

# The reference, and the public entry point that runs the C++/CUDA kernel where one is built.
PROJECTIONS = {"reference": mxfp4.fake_quantize, "dispatch": quant.fake_quantize_mxfp4}


def oracle_block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """e = clamp(ceil(log2(amax / 6)), -126, 125): the smallest e with amax <= 6 * 2**e, found by
    exact fp64 comparisons (6 * 2**e is exact); zero and non-finite amaxes give -126."""
    a = amax.double()
    finite = torch.isfinite(a) & (a > 0)
    safe = torch.where(finite, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(safe / 6)).long()  # within one of the answer; fixed up below
    for _ in range(2):
        e = torch.where(safe > 6 * torch.exp2(e.double()), e + 1, e)
        e = torch.where(safe <= 6 * torch.exp2(e.double() - 1), e - 1, e)
    return torch.where(finite, e.clamp(-126, 125), torch.full_like(e, -126))


def oracle_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest grid magnitude of |v| in [0, 6] (fp64); ties go to the even code index."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    d = (v.abs()[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    idx = torch.arange(8)
    # among the nearest candidates prefer an even code: score 2 for even, 1 for odd
    score = (d == best).long() * (2 - idx % 2)
    return grid[score.argmax(-1)]


def oracle_fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """sign(w) * e2m1(min(|w| / 2**e, 6)) * 2**e in fp64, blocks holding NaN/Inf -> NaN."""
    blocks = w.double().reshape(-1, 32)
    e = oracle_block_exponent(blocks.abs().amax(-1))[:, None].double()
    scaled = torch.clamp(blocks.abs() / torch.exp2(e), max=6.0)  # exact in fp64
    mag = oracle_e2m1(torch.nan_to_num(scaled)) * torch.exp2(e)
    out = torch.where(torch.signbit(blocks), -mag, mag)
    bad = ~torch.isfinite(blocks).all(-1, keepdim=True)
    out = out.masked_fill(bad, float("nan"))
    return out.reshape(w.shape).to(w.dtype)  # exact: q * 2**e has at most 2 significant bits


@pytest.fixture(params=sorted(PROJECTIONS))
def project(request):
    return PROJECTIONS[request.param]


def _compare(w: torch.Tensor, project) -> None:
    got = project(w)
    want = oracle_fake_quantize(w)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert_bits_equal(got[~nan], want[~nan], "MXFP4 fake quantize")


def test_all_bf16_patterns_in_bit_order(project):
    # consecutive bit patterns share a block: each block spans one exponent's mantissas
    _compare(all_bf16_patterns().reshape(2048, 32), project)


def test_all_bf16_patterns_shuffled(project):
    # shuffled, blocks mix tiny, huge, subnormal, zero and non-finite elements
    w = all_bf16_patterns()
    perm = torch.randperm(w.numel(), generator=torch.Generator().manual_seed(0))
    _compare(w[perm].reshape(64, 1024), project)


def test_all_bf16_patterns_finite_only_shuffled(project):
    w = all_bf16_patterns()
    w = w[torch.isfinite(w)]
    w = w[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(1))]
    w = w[: w.numel() // 32 * 32].reshape(-1, 32)
    assert bool(torch.isfinite(project(w)).all())  # no finite block is poisoned
    _compare(w, project)


def test_fp32_wide_range_against_oracle(project):
    g = torch.Generator().manual_seed(2)
    exps = torch.randint(-149, 128, (512, 4, 1), generator=g).expand(512, 4, 32).float()
    w = (torch.randn(512, 128, generator=g) * torch.exp2(exps.reshape(512, 128))).float()
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    _compare(w, project)


def test_block_exponent_from_bits_matches_definition():
    amax = all_bf16_patterns().float().abs()
    got = mxfp4.block_exponent(amax)
    want = oracle_block_exponent(amax)
    # subnormal amaxes: the reference gives -126 directly; the definition clamps to -126 too
    assert torch.equal(got.long(), want)


def test_straight_through_gradient_and_dtype_checks(project):
    w = torch.randn(4, 64, requires_grad=True)
    out = project(w)
    out.backward(torch.arange(256.0).reshape(4, 64))
    assert torch.equal(w.grad, torch.arange(256.0).reshape(4, 64))
    with pytest.raises(TypeError, match="bf16 or fp32 weights; got torch.float16"):
        project(torch.randn(4, 64).half())
    with pytest.raises(ValueError, match="last dim divisible by 32; got shape \\(4, 48\\)"):
        project(torch.randn(4, 48))
