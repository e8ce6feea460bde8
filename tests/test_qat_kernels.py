"""The fused MXFP4 QAT ops (csrc/mxfp4_qat*.{cpp,cu}) byte for byte against the reference.

CPU kernels run where the extension is built; CUDA ones on the GPU machine (`-m cuda`), which
also runs the native FP8 block GEMM against the emulated one and the CUDA-graph replay of the
weight cache's skip gate.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qtensor.backends import GemmBackend, QuantBackend, qat_quant_backend
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.gemm import gemm_plan, quantized_mm
from qtensor.qat import convert, hosts, kernels
from qtensor.tensors import FP8BlockTensor

ON_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")


def _has_kernel(device_type: str) -> bool:
    return qat_quant_backend(device_type) is not QuantBackend.REFERENCE


def corpus() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(66)
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    shuffled = every_bf16[torch.randperm(65536, generator=g)]
    normal = torch.randn(256, 256, generator=g) * 0.02
    wide = torch.randn(256, 256, generator=g) * torch.exp2(torch.randint(-140, 120, (256, 8), generator=g)
                                                            .repeat_interleave(32, 1).float())
    bits = torch.randint(-(2**31), 2**31 - 1, (128, 128), generator=g, dtype=torch.int64)
    fuzz = bits.to(torch.int32).view(torch.float32)
    poisoned = normal.clone()
    poisoned[7, 100] = float("nan")
    poisoned[130, 3] = float("-inf")
    return [every_bf16.reshape(256, 256), shuffled.reshape(256, 256), normal, normal.bfloat16(),
            wide, fuzz, poisoned, normal.t().contiguous().t()[:128, :]]


def u8(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


def assert_same_bytes(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        diff = (u8(g) != u8(w)).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:3].tolist()}"


def check_device(device: str) -> None:
    for w in corpus():
        w = w.to(device)
        for direct in (False, True):
            for row, col in ((True, True),) if w.shape[0] > 128 else ((True, False), (False, True)):
                got = torch.ops.qtensor.mxfp4_qat_mxfp8(w, direct, row, col)
                want = kernels.reference_mxfp8(w.cpu(), direct, row, col)
                assert_same_bytes([t.cpu() for t in got], want)
            got = torch.ops.qtensor.mxfp4_qat_fp8_block(w, direct)
            assert_same_bytes([t.cpu() for t in got], convert.fp8_block_weight(w.cpu(), direct))


@pytest.mark.skipif(not _has_kernel("cpu"), reason="qtensor._C (CPU kernels) is not built")
def test_cpu_kernels_match_reference():
    check_device("cpu")


@pytest.mark.skipif(not _has_kernel("cpu"), reason="qtensor._C (CPU kernels) is not built")
def test_cpu_kernel_opcheck():
    w = torch.randn(128, 128)
    torch.library.opcheck(torch.ops.qtensor.mxfp4_qat_mxfp8.default, (w, True, True, True))
    torch.library.opcheck(torch.ops.qtensor.mxfp4_qat_fp8_block.default, (w, False))


def test_wrapper_rejects_before_any_kernel():
    # The Python wrappers validate first: a C++ TORCH_CHECK on a shape crashed the process on
    # the GPU machine (torch 2.11), so no user error should depend on it.
    with pytest.raises(TypeError, match="bf16 or fp32"):
        kernels.mxfp4_qat_mxfp8(torch.zeros(32, 32, dtype=torch.float16), False)
    with pytest.raises(ValueError, match="divisible by 128"):
        kernels.mxfp4_qat_fp8_block(torch.zeros(96, 128), True)
    with pytest.raises(ValueError, match="divisible by 32"):
        kernels.mxfp4_qat_mxfp8(torch.zeros(48, 64), True)
    rows_only, _ = kernels.mxfp4_qat_mxfp8(torch.zeros(48, 64), True, columnwise=False)
    assert rows_only.qdata.shape == (48, 64)


@pytest.mark.cuda
@needs_cuda
def test_cuda_kernels_match_reference():
    assert _has_kernel("cuda"), "the CUDA extension must be built on the GPU machine"
    check_device("cuda")


# Largest |native - emulated| over the emulated output's largest magnitude. The products are
# exact; sm_90's FP8 tensor cores sum each 128-element K block with fewer bits than fp32 (the
# measured error is 2-3e-4), then the blocks in fp32.
NATIVE_FP8_BOUND = 1e-3


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("m, n, k", [(256, 384, 512), (260, 640, 640), (384, 512, 768),
                                     (128, 1024, 1024)])
def test_cuda_scaled_mm_block_gemms_match_emulation(m, n, k):
    """fprop, dgrad and wgrad of the FP8 block host natively against the emulation, with K-block
    counts of 2 to 8 (tile scales with a count that is not a multiple of 4 go as 1x128 rows) and
    a token count that is not a multiple of 128 on the fprop (its 1x128 rows need none)."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(m, k, generator=g)).bfloat16().cuda()
    dy = (torch.randn(m, n, generator=g)).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) * 0.05).cuda()
    host = hosts.Host.FP8_BLOCK128
    assert hosts.gemm_backend(host, x.device, True) is GemmBackend.SCALED_MM
    assert hosts.gemm_backend(host, x.device, False) is GemmBackend.EMULATED
    rows, cols = FP8BlockSpec("1x128"), FP8BlockSpec("1x128", columnwise=True)
    wop = FP8BlockTensor.wrap(w, FP8BlockSpec("128x128"), convert.fp8_block_weight(w, True),
                              QuantBackend.REFERENCE)
    xr, dr = FP8BlockTensor.from_spec(x, rows), FP8BlockTensor.from_spec(dy, rows)
    pairs = [(xr, wop.t()), (dr, wop)]  # fprop, dgrad
    if m % 128 == 0:  # wgrad: columnwise operands need whole 128-token blocks
        xc, dc = FP8BlockTensor.from_spec(x, cols), FP8BlockTensor.from_spec(dy, cols)
        pairs.append((dc.t(), xc))
    for a, b in pairs:
        assert gemm_plan(a, b) is GemmBackend.EMULATED
        emulated = quantized_mm(a, b, out_dtype=torch.float32)
        a_n, b_n = (t.replace(gemm_backend=GemmBackend.SCALED_MM.value) for t in (a, b))
        assert gemm_plan(a_n, b_n) is GemmBackend.SCALED_MM
        for dtype in (torch.float32, torch.bfloat16):
            native = quantized_mm(a_n, b_n, out_dtype=dtype)
            assert native.dtype == dtype and native.shape == emulated.shape
            err = (native.float() - emulated).abs().max() / emulated.abs().max()
            bound = NATIVE_FP8_BOUND + (2.0 ** -8 if dtype == torch.bfloat16 else 0.0)
            assert err < bound, (a.shape, b.shape, dtype, err.item())
    # With a bias: added in fp32 after the product, as the emulation does.
    bias = torch.randn(n, generator=g).cuda()
    xr_n = xr.replace(gemm_backend=GemmBackend.SCALED_MM.value)
    wt_n = wop.t().replace(gemm_backend=GemmBackend.SCALED_MM.value)
    native = quantized_mm(xr_n, wt_n, bias, out_dtype=torch.float32)
    emulated = quantized_mm(xr, wop.t(), bias, out_dtype=torch.float32)
    assert (native - emulated).abs().max() / emulated.abs().max() < NATIVE_FP8_BOUND


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("direct", [False, True])
def test_cuda_graph_replay_honours_skip_update(direct):
    from qtensor.qat import MXFP4QATConfig, quantize_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False)).cuda().bfloat16()
    quantize_(model, MXFP4QATConfig(host="fp8_block128", direct=direct))
    lin = model[0]
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    skip = torch.tensor(False, device="cuda")
    with torch.no_grad():
        lin(x, skip_update=skip)  # warm-up: the cache miss allocates outside the graph
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lin(x, skip_update=skip)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lin(x, skip_update=skip)
        graph.replay()
        y_first = y.clone()
        lin.weight.mul_(2.0)  # the optimizer moves the weight between micro-batches
        skip.fill_(True)
        graph.replay()
        assert torch.equal(y, y_first)  # the replay reused the first micro-batch's bytes
        skip.fill_(False)
        graph.replay()
        assert torch.equal(y, y_first * 2)  # powers of two scale the projection exactly


def test_fp8_block_scale_layouts():
    """torch._scaled_mm's scale tensors: 1x128 left scales column-major; tile scales as their
    [K/128, N/128] transpose view when the K-block count is a multiple of 4, else expanded to
    one 1x128 row per weight row (each carrying its tile's scale); 1x128 right scales [K/128, N]
    row-major."""
    from qtensor.ops.fp8_block import scaled_mm_scales as fp8_block_scales

    a = torch.rand(260, 5)
    tiles5, tiles8, rows = torch.rand(3, 5), torch.rand(3, 8), torch.rand(384, 5)
    sa, sb = fp8_block_scales(a, tiles8, True)
    assert torch.equal(sa, a) and sa.stride() == (1, 260)
    assert torch.equal(sb, tiles8.t()) and sb.stride() == (1, 8)
    _, sb = fp8_block_scales(a, tiles5, True)
    assert sb.shape == (5, 384) and sb.is_contiguous()
    assert torch.equal(sb.t(), tiles5.repeat_interleave(128, dim=0))
    _, sb = fp8_block_scales(a, rows, False)
    assert torch.equal(sb, rows.t()) and sb.is_contiguous()
