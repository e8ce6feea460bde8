"""MXFP4Tensor: its bytes against the formats/mxfp4 reference on every bf16 bit pattern, its
decode against transformers' gpt-oss reader (an independent decoder), the view ops the gpt-oss
expert forward takes, the emulated product, and checkpoint round trips."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import qtensor
from qtensor import MXFP4Spec, MXFP4Tensor
from qtensor.backends import GemmBackend
from qtensor.formats import mxfp4
from qtensor.formats.elements import unpack_fp4
from qtensor.gemm.dense import gemm_plan
from qtensor.qat import decode_weight, export_weight


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern once, as [2, 32768]: 2048 blocks of 32 per row."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(2, 32768)


def test_bytes_are_the_reference_decomposition_on_every_bf16_pattern():
    x = _all_bf16()
    t = MXFP4Tensor.from_hp(x, check_finite=False)
    codes, e = mxfp4.decompose(x)
    finite = torch.isfinite(x.float()).reshape(2, -1, 32).all(-1)
    assert (~finite).any() and finite.any()  # both kinds of block are exercised
    assert torch.equal(unpack_fp4(t.qdata), codes)
    assert t.scale.dtype == torch.uint8
    assert torch.equal(t.scale[finite], (e + 127)[finite].to(torch.uint8))
    assert (t.scale[~finite] == 255).all()
    # The decode is the QAT projection, NaN blocks included (bitwise, NaNs compared as NaNs).
    want = mxfp4.fake_quantize_values(x)
    assert torch.equal(t.dequantize().isnan(), want.isnan())
    assert torch.equal(t.dequantize().nan_to_num(), want.nan_to_num())
    # Finite blocks: the same bytes as the QAT export writes.
    fin = x.reshape(-1, 32)[finite.reshape(-1)].reshape(-1, 64)
    blocks, scales = export_weight(fin)
    tf = MXFP4Tensor.from_hp(fin)
    assert torch.equal(tf.qdata, blocks.reshape(tf.qdata.shape)) and torch.equal(tf.scale, scales)


def test_decode_equals_transformers_gpt_oss_reader():
    """transformers' convert_moe_packed_tensors (its own LUT and ldexp) decodes the same bytes,
    read as gpt-oss [E, N, K/32, 16] blocks, to the same values (it returns the [E, K, N]
    parameter layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 64, 4), dtype=torch.uint8, generator=g)
    scales[0, 0, 0], scales[1, 2, 3] = 0, 254  # the smallest and largest finite scale
    t = MXFP4Tensor.from_bytes(blocks, scales, dtype=torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(t.transpose(-1, -2).dequantize(), theirs)
    for e in range(3):
        assert torch.equal(t.dequantize()[e], decode_weight(blocks[e], scales[e]))


def test_from_bytes_keeps_the_bytes_and_refuses_wrong_ones():
    blocks = torch.randint(0, 256, (4, 8, 2, 16), dtype=torch.uint8)
    scales = torch.full((4, 8, 2), 127, dtype=torch.uint8)
    scales[0, 0, 1] = 255
    t = MXFP4Tensor.from_bytes(blocks, scales)
    assert t.shape == (4, 8, 64) and t.axis == "rowwise" and t.dtype == torch.bfloat16
    assert t.qdata.data_ptr() == blocks.data_ptr() and t.scale is scales  # a view, no copy
    assert t.dequantize()[0, 0, 32:].isnan().all() and t.dequantize()[0, 0, :32].isfinite().all()
    assert not t.input_was_finite()
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[..., R, K/32, 16\]"):
        MXFP4Tensor.from_bytes(blocks.view(4, 8, 4, 8), scales)
    with pytest.raises(ValueError, match="scales must be uint8 UE8M0 codes"):
        MXFP4Tensor.from_bytes(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="scales must be uint8"):
        MXFP4Tensor.from_bytes(blocks, scales.float())


def test_columnwise_bytes_are_the_transposes_rowwise_bytes():
    x = _x(2, 64, 96)
    col = MXFP4Tensor.from_hp(x, columnwise=True)
    row = MXFP4Tensor.from_hp(x.transpose(-1, -2).contiguous())
    assert torch.equal(col.qdata, row.qdata) and torch.equal(col.scale, row.scale)
    assert torch.equal(col.dequantize(), row.dequantize().transpose(-1, -2))
    assert col.spec == MXFP4Spec(columnwise=True) and col.axis == "columnwise"


def test_non_finite_input_is_refused_by_default():
    x = _x(4, 64)
    x[1, 40] = float("inf")
    with pytest.raises(ValueError, match="check_finite=False"):
        MXFP4Tensor.from_hp(x)
    t = MXFP4Tensor.from_hp(x, check_finite=False)
    assert t.scale[1, 1] == 255 and t.dequantize()[1, 32:].isnan().all()
    with pytest.raises(TypeError, match="no stochastic-rounding generator"):
        MXFP4Tensor.from_spec(x, MXFP4Spec(), generator=torch.Generator())


def test_view_ops_commute_with_decode():
    """transpose, select and slice along non-block dims (and block dims at multiples of 32),
    view keeping the last dim: each equals the op on the decoded tensor."""
    t = MXFP4Tensor.from_hp(_x(3, 64, 96)).transpose(-1, -2)  # [3, 96, 64] columnwise
    d = t.dequantize()
    cases = [
        (lambda v: v[1], "select dim 0"),
        (lambda v: v[torch.tensor(2)], "a 0-d tensor index (GptOssExperts.forward)"),
        (lambda v: v[:, 32:64], "slice the block dim"),
        (lambda v: v[:, :, 8:40], "slice a non-block dim"),
        (lambda v: v.select(-1, 5), "select the last dim: blocks along the new last dim"),
        (lambda v: v[0].t(), "transpose back to rowwise"),
        (lambda v: v.detach().clone(), "detach, clone"),
    ]
    for op, what in cases:
        assert torch.equal(op(t).dequantize(), op(d).contiguous()), what
    assert t.select(-1, 5).axis == "rowwise" and t[0].axis == "columnwise"
    r = MXFP4Tensor.from_hp(_x(4, 6, 64))
    assert torch.equal(r.view(24, 64).dequantize(), r.dequantize().view(24, 64))
    with pytest.raises(ValueError, match="only at multiples of 32"):
        t[:, 16:48]
    with pytest.raises(ValueError, match="cannot select along its block dim"):
        t[:, 3]
    with pytest.raises(ValueError, match="reshaped only when it is rowwise"):
        t.reshape(3, 64, 96)


def test_products_run_the_emulated_reference():
    """bf16 @ a columnwise 2-D weight (the expert forward), F.linear of a rowwise weight and
    MXFP4 x MXFP4 all equal fp32 products of the decoded operands (bitwise: one fp32 matmul of
    the same exact values, then the cast)."""
    w = MXFP4Tensor.from_hp(_x(2, 64, 96, seed=1))  # stored [E, N, K]
    experts = w.transpose(-1, -2)  # [E, K, N]
    a = _x(5, 96, seed=2)
    bias = _x(64, seed=3)
    for e in range(2):
        out = a @ experts[e]
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, (a.float() @ experts[e].unit_values()).bfloat16())
    assert torch.equal(F.linear(a, w[1], bias),
                       (a.float() @ w[1].unit_values().t() + bias.float()).bfloat16())
    qa = MXFP4Tensor.from_hp(a)
    assert torch.equal(torch.mm(qa, experts[0]),
                       (qa.unit_values() @ experts[0].unit_values()).bfloat16())
    assert gemm_plan(a, experts[0]) is GemmBackend.EMULATED
    forced = qtensor.gemm.with_gemm_backend(experts[0], "emulated")
    assert torch.equal(a @ forced, a @ experts[0])
    with pytest.raises(ValueError, match="blocks along the reduction dim"):
        _x(5, 64) @ w[0]  # rowwise [N, K]: blocks along N, not along the reduction dim


def test_checkpoint_round_trips(tmp_path):
    sd = {"w": MXFP4Tensor.from_hp(_x(2, 64, 96)).transpose(-1, -2),
          "v": MXFP4Tensor.from_hp(_x(64, 96), columnwise=True), "b": _x(8)}
    qtensor.save_file(sd, tmp_path / "m.safetensors")
    back = qtensor.load_file(tmp_path / "m.safetensors")
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    pickled = torch.load(buf, weights_only=True)
    for got in (back, pickled):
        for k in ("w", "v"):
            assert type(got[k]) is MXFP4Tensor and got[k].axis == sd[k].axis
            assert got[k].spec == sd[k].spec and got[k].shape == sd[k].shape
            assert torch.equal(got[k].qdata, sd[k].qdata) and torch.equal(got[k].scale,
                                                                         sd[k].scale)
        assert torch.equal(got["b"], sd["b"])


def test_compiled_expert_product_is_the_eager_one():
    """torch.compile(fullgraph=True) of the expert forward's product: the graph holds the
    opaque qtensor::mxfp4_mm, so the bits are eager's."""
    experts = MXFP4Tensor.from_hp(_x(2, 64, 96, seed=4)).transpose(-1, -2)
    x = _x(5, 96, seed=5)
    f = torch.compile(lambda x, w: x @ w[1], fullgraph=True)
    assert torch.equal(f(x, experts), x @ experts[1])
