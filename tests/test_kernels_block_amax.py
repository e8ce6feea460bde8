"""NVFP4 columnwise casts with one amax per block (a grouped linear's experts cast in one pass):
the CPU and CUDA kernels against the reference, byte for byte, and the reference against each
block's own tensor cast.

A block quantized with amax A is the block of a tensor whose amax is A, so a per-block amax that
holds each expert's amax over that expert's blocks gives every expert its own cast's bytes
(tests/test_training_grouped.py checks that end to end).
"""

from __future__ import annotations

import pytest
import torch
from conftest import all_bf16_patterns, assert_bytes_equal, kernel_devices

from qtensor.formats import nvfp4
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.ops import quant as Q

pytestmark = pytest.mark.skipif(Q.EXTENSION_ERROR is not None, reason="qtensor._C is not built")
DEVICES = kernel_devices()
COL = NVFP4Spec(columnwise=True)


def _check(x: torch.Tensor, amax: torch.Tensor, spec: NVFP4Spec = COL) -> None:
    ref = nvfp4.quantize(x.cpu(), spec, amax=amax.cpu())
    q, s = Q.nvfp4_codes(x, amax, spec, None)
    what = f"{spec} {x.dtype} {tuple(x.shape)}"
    assert_bytes_equal(q.cpu(), ref.qdata, f"codes {what}")
    assert_bytes_equal(s.cpu(), ref.scale, f"scales {what}")


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """[C, T/16]: each 16-token block's own max |x| (the result's layout)."""
    t, c = x.shape
    return x.float().abs().reshape(t // 16, 16, c).amax(1).t().contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_all_bf16_patterns_each_block_its_own_amax(device):
    # Every pattern in a block of its own amax (finite, +-0, subnormal, +-inf, NaN), then the
    # same blocks under amaxes 4x and 1/4x theirs (saturated and coarse scales), 0, inf, NaN.
    x = all_bf16_patterns().reshape(4096, 16).to(device)  # columnwise: 16 rows of 256 blocks
    own = _block_amax(x)
    _check(x, own)
    g = torch.Generator().manual_seed(0)
    pick = torch.randint(0, 6, own.shape, generator=g).to(device)
    special = torch.stack([own * 4, own / 4, torch.zeros_like(own),
                           torch.full_like(own, float("inf")), torch.full_like(own, float("nan")),
                           own])
    _check(x, special.gather(0, pick[None]).squeeze(0).contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_shapes_and_dtypes(device, dtype):
    # Several tiles of rows and columns, an odd number of 16-token blocks, per-block amaxes of
    # 1e-30 .. 1e30 around the data's.
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16 * 37, 272, generator=g) * 3).to(dtype)
    scale = torch.exp2(torch.randint(-100, 100, (272, 37), generator=g).float())
    amax = (_block_amax(x) * scale).to(device)
    _check(x.to(device), amax)
    _check(x.to(device), amax, NVFP4Spec(columnwise=True, e4m3_bound=256))


@pytest.mark.parametrize("device", DEVICES)
def test_one_amax_everywhere_is_the_per_tensor_cast(device):
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(2)).bfloat16().to(device)
    a = Q.amax(x, columnwise=True)
    q, s = Q.nvfp4_codes(x, a.expand(48, 4).contiguous(), COL, None)
    q1, s1 = Q.nvfp4_codes(x, a, COL, None)
    assert_bytes_equal(q, q1, "codes")
    assert_bytes_equal(s, s1, "scales")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_per_block_amax_raises(device):
    x = torch.randn(64, 32).to(device)
    amax = torch.ones(32, 4, device=device)
    with pytest.raises(RuntimeError, match="per-block amax .* columnwise cast without 4over6"):
        Q.nvfp4_codes(x.t().contiguous(), amax, NVFP4Spec(), None)
    with pytest.raises(RuntimeError, match="per-block amax .* columnwise cast without 4over6"):
        Q.nvfp4_codes(x, amax, NVFP4Spec(columnwise=True, fourover6="mae"), None)
    with pytest.raises(RuntimeError, match=r"one per block \[32, 4\]"):
        Q.nvfp4_codes(x, torch.ones(32, 3, device=device), COL, None)
    with pytest.raises(RuntimeError, match="scalar or per-row amax"):
        torch.ops.qtensor.hybrid_quantize(x, amax, 0, 0, 448, False, False, None)


def test_reference_checks_the_per_block_amax():
    x = torch.randn(64, 32)
    with pytest.raises(ValueError, match="plain columnwise cast"):
        nvfp4.quantize(x, NVFP4Spec(columnwise=True, rht=True), amax=torch.ones(32, 4))
    with pytest.raises(ValueError, match=r"must be \[R, C/16\] = \(32, 4\)"):
        nvfp4.quantize(x, COL, amax=torch.ones(4, 32))
