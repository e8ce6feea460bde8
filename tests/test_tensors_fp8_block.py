"""FP8BlockTensor: its bytes are formats/fp8_block.py's, it decodes, transposes and slices as its
layout says, its products through quantized_mm are qtensor::fp8_block_mm's reference, and it
round trips through safetensors and torch.load(weights_only=True)."""

from __future__ import annotations

import io

import pytest
import torch

import qtensor
from qtensor.backends import GemmBackend
from qtensor.formats import fp8_block
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.gemm import gemm_plan, quantized_mm
from qtensor.ops import gemm_ops
from qtensor.tensors import FP8BlockTensor, quantize_spec

ROWS, COLS, TILES = FP8BlockSpec("1x128"), FP8BlockSpec("1x128", columnwise=True), \
    FP8BlockSpec("128x128")


def _x(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


@pytest.mark.parametrize("spec", [ROWS, COLS, TILES], ids=repr)
def test_bytes_are_the_reference(spec):
    x = _x(256, 384)
    t = quantize_spec(x, spec)
    assert type(t) is FP8BlockTensor and t.spec == spec
    q, s = fp8_block.quantize(x, spec)
    assert torch.equal(_bits(t.qdata), _bits(q)) and torch.equal(_bits(t.scale), _bits(s))
    want = fp8_block.dequantize(q, s, spec)
    assert torch.equal(t.dequantize(torch.float32), want)
    assert t.dequantize().dtype == torch.bfloat16
    # Not a no-op: the decoded values differ from the input somewhere.
    assert not torch.equal(want, x.float())


def test_transpose_flips_1x128_and_keeps_tiles():
    x = _x(256, 384)
    row = FP8BlockTensor.from_spec(x, ROWS)
    assert row.t().axis == "columnwise" and row.t().spec == ROWS  # the spec it was made with
    assert torch.equal(row.t().dequantize(), row.dequantize().t())
    tiles = FP8BlockTensor.from_spec(x, TILES)
    tt = tiles.t()
    assert tt.block == "128x128" and tt.shape == (384, 256) and tt.scale.shape == (3, 2)
    assert torch.equal(tt.dequantize(), tiles.dequantize().t())
    # A tile tensor is an operand on either side; a 1x128 one only on the side of its blocks.
    assert tiles.gemm_operand("left") is tiles and tiles.gemm_operand("right") is tiles
    with pytest.raises(ValueError, match="columnwise=True"):
        row.gemm_operand("right")


def test_slice_keeps_blocks_whole():
    tiles = FP8BlockTensor.from_spec(_x(256, 384), TILES)
    part = tiles[128:256]
    assert torch.equal(part.dequantize(), tiles.dequantize()[128:256])
    with pytest.raises(ValueError, match="multiples of 128"):
        tiles[:, 64:192]
    row = FP8BlockTensor.from_spec(_x(4, 256), ROWS)
    assert torch.equal(row[1:3].dequantize(), row.dequantize()[1:3])


@pytest.mark.parametrize("case", ["fprop", "dgrad", "wgrad"])
def test_gemm_through_quantized_mm_is_the_op_reference(case):
    x, w, dy = _x(256, 384, seed=1), _x(128, 384, seed=2, scale=0.05), _x(256, 128, seed=3)
    wt = FP8BlockTensor.from_spec(w, TILES)
    bias = torch.randn(128 if case == "fprop" else 384 if case == "dgrad" else 384)
    if case == "fprop":
        a, b = FP8BlockTensor.from_spec(x, ROWS), wt.t()
        ref = (a.qdata, a.scale, wt.qdata, wt.scale, True)
    elif case == "dgrad":
        a, b = FP8BlockTensor.from_spec(dy, ROWS), wt
        ref = (a.qdata, a.scale, wt.qdata.t(), wt.scale.t(), True)
    else:
        a = FP8BlockTensor.from_spec(dy, COLS).t()
        b = FP8BlockTensor.from_spec(x, COLS)
        ref = (a.qdata, a.scale, b.qdata.t(), b.scale.t(), False)
    assert gemm_plan(a, b) is GemmBackend.EMULATED
    got = quantized_mm(a, b, bias, out_dtype=torch.bfloat16)
    want = gemm_ops.reference_fp8_block_mm(*ref, bias, torch.bfloat16)
    assert torch.equal(got, want)
    # ... which is the exact decoded product (+ bias in fp32), independently of the op.
    exact = a.dequantize(torch.float32) @ b.dequantize(torch.float32) + bias
    assert torch.equal(got, exact.bfloat16())


def test_gemm_rejects_what_the_op_cannot_take():
    wt = FP8BlockTensor.from_spec(_x(128, 256), TILES)
    with pytest.raises(ValueError, match="two FP8 block operands"):
        quantized_mm(_x(128, 256), wt.t())
    with pytest.raises(ValueError, match="left operand of an FP8 block GEMM"):
        quantized_mm(wt, FP8BlockTensor.from_spec(_x(256, 128), COLS))


def test_scaled_mm_backend_falls_back_off_cuda():
    """A tensor asking for the native call still multiplies on the CPU, through the op."""
    x = FP8BlockTensor.from_spec(_x(128, 256), ROWS)
    wt = FP8BlockTensor.from_spec(_x(128, 256, seed=4), TILES)
    native = [t.replace(gemm_backend=GemmBackend.SCALED_MM.value) for t in (x, wt)]
    assert gemm_plan(native[0], native[1].t()) is GemmBackend.EMULATED
    assert torch.equal(quantized_mm(native[0], native[1].t()), quantized_mm(x, wt.t()))


@pytest.mark.parametrize("spec", [ROWS, COLS, TILES], ids=repr)
def test_checkpoint_and_torch_load_round_trip(tmp_path, spec):
    t = FP8BlockTensor.from_spec(_x(256, 384), spec)
    path = tmp_path / "t.safetensors"
    qtensor.save_file({"w": t}, path)
    back = qtensor.load_file(path)["w"]
    assert repr(back) == repr(t)
    assert torch.equal(_bits(back.qdata), _bits(t.qdata))
    assert torch.equal(_bits(back.scale), _bits(t.scale))
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert repr(loaded) == repr(t) and torch.equal(loaded.dequantize(), t.dequantize())


def test_non_finite_input_is_reported():
    x = _x(128, 256)
    x[3, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        FP8BlockTensor.from_spec(x, ROWS)
    poisoned = FP8BlockTensor.from_spec(x, ROWS, check_finite=False)
    assert torch.isnan(poisoned.scale[3, 0]) and not torch.isnan(poisoned.scale[4, 0])


def test_explicit_gemm_backend_asks_the_format(monkeypatch):
    """with_gemm_backend checks scaled_mm against the operand's own format (FP8 blocks run
    natively from sm_90, MX/NVFP4 from sm_100) and refuses triton for formats without a Triton
    kernel, instead of letting the product fall back to the reference unasked."""
    from qtensor.backends import ScaledMMFormat
    from qtensor.gemm import dense
    from qtensor.tensors import MXFP4Tensor

    asked = []

    def capable(backend, device, scaled=ScaledMMFormat.MX_BLOCK):
        asked.append(scaled)
        return None

    monkeypatch.setattr(dense, "gemm_backend_problem", capable)
    tiles = FP8BlockTensor.from_spec(_x(256, 384), TILES)
    assert dense.with_gemm_backend(tiles, "scaled_mm").gemm_backend == "scaled_mm"
    assert asked == [ScaledMMFormat.FP8_BLOCK128]
    with pytest.raises(ValueError, match="no Triton kernel for fp8_block"):
        dense.with_gemm_backend(tiles, "triton")
    mx = MXFP4Tensor.from_hp(_x(64, 96))
    with pytest.raises(ValueError, match="no Triton kernel for mxfp4"):
        dense.with_gemm_backend(mx, "triton")
    with pytest.raises(ValueError, match="no native MXFP4 GEMM"):
        dense.with_gemm_backend(mx, "scaled_mm")


def _canon_nan(t):
    """E4M3 bytes with -NaN (0xFF) read as NaN (0x7F): a NaN's sign inside torch is not part of
    the format."""
    b = t.contiguous().view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b)


def _check_op_against_reference(x, columnwise):
    data, scale = torch.ops.qtensor.fp8_block_quantize(x, columnwise)
    want = fp8_block.quantize(x, COLS if columnwise else ROWS)
    assert data.shape == want.qdata.shape and scale.shape == want.scale.shape
    assert torch.equal(_canon_nan(data), _canon_nan(want.qdata)), "data bytes differ"
    assert torch.equal(scale.view(torch.int32), want.scale.view(torch.int32)), "scales differ"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_all_bf16_patterns_and_edges():
    """The Triton kernel of qtensor::fp8_block_quantize byte for byte against the reference on
    every bf16 pattern (each block of 128 consecutive patterns: zeros, subnormal-only blocks,
    Inf and NaN blocks, the largest values), both directions; then fp32 and fp16 inputs (fp32
    values near the top code and subnormal amaxes), all-zero and -0 blocks, ragged row counts
    and a 3-D input, and the tensor class's bytes."""
    from conftest import all_bf16_patterns

    p = all_bf16_patterns().cuda()
    _check_op_against_reference(p.reshape(512, 128), False)
    _check_op_against_reference(p.reshape(128, 512), True)
    _check_op_against_reference(p.reshape(512, 128).t().contiguous(), True)
    g = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(300, 640, device="cuda", generator=g)
    x[0] = 3.0e38  # code 254 territory
    x[1] = 1.0e-40  # an fp32 subnormal amax
    x[2] = 0.0
    x[3] = -0.0
    x[4, 7] = float("inf")
    x[5, 300] = float("nan")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        _check_op_against_reference(xd, False)
        _check_op_against_reference(xd[:256], True)
    _check_op_against_reference(x.reshape(3, 100, 640), False)
    t = FP8BlockTensor.from_spec(x[:256].bfloat16(), COLS, check_finite=False)
    assert t.quant_backend == "cuda"
    want = fp8_block.quantize(x[:256].bfloat16(), COLS)
    assert torch.equal(_canon_nan(t.qdata), _canon_nan(want.qdata))
