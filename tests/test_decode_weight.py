"""DecodeWeight (qtensor/tensors/decode.py) and the configs' `layout`: a packed weight multiplies
as its canonical tensor does, gives the canonical tensor back bit for bit, and every checkpoint
path sees the canonical bytes (a packed model's files equal a canonical model's, byte for
byte); loading packs again. Also MXFP4WeightOnlyConfig through both quantize_ entry points."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import qtensor
from qtensor import (DecodeWeight, MXFP4Tensor, MXFP4WeightOnlyConfig, MXFP8Tensor,
                     MXFP8WeightOnlyConfig, NVFP4Spec, NVFP4Tensor, NVFP4WeightOnlyConfig,
                     quantize_, to_decode_layout)
from qtensor.checkpoint import state_dict as sd_io

CONFIGS = {
    "nvfp4": NVFP4WeightOnlyConfig(),
    "nvfp4_rowscaled_b256": NVFP4WeightOnlyConfig(weight=NVFP4Spec(row_scaled=True,
                                                                   e4m3_bound=256)),
    "nvfp4_2d": NVFP4WeightOnlyConfig(weight=NVFP4Spec(block_2d=True)),
    "mxfp8": MXFP8WeightOnlyConfig(),
    "mxfp4": MXFP4WeightOnlyConfig(),
}


def _models(config, seed=0):
    """(packed, canonical) copies of one small bf16 model, quantized with `config`."""
    torch.manual_seed(seed)

    def make():
        return nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 64, bias=False)).bfloat16()

    packed, canonical = make(), make()
    canonical.load_state_dict(packed.state_dict())
    quantize_(packed, type(config)(**{**config.__dict__, "layout": "decode"}))
    quantize_(canonical, type(config)(**{**config.__dict__, "layout": "canonical"}))
    return packed, canonical


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_model_equals_canonical_model(name):
    packed, canonical = _models(CONFIGS[name])
    assert isinstance(packed[0].weight, DecodeWeight)
    assert not isinstance(canonical[0].weight, DecodeWeight)
    x = torch.randn(2, 7, 96, dtype=torch.bfloat16)
    assert torch.equal(packed(x), canonical(x))
    assert torch.equal(torch.compile(packed, backend="eager", fullgraph=True)(x), canonical(x))


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_model_compiles_with_inductor(name):
    """Inductor, one graph for every batch and sequence length (the op's fake kernel gives the
    shapes; sizes 0 and 1 are specialized by Dynamo, so they are not in the dynamic set), and
    bitwise equal to the canonical model run eagerly, one-token decode included."""
    from test_compile_inference import compile_and_compare

    packed, canonical = _models(CONFIGS[name], seed=3)
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(b, t, 96, generator=gen, dtype=torch.bfloat16) for b, t in
              ((2, 3), (3, 5), (2, 9))]
    compile_and_compare(packed, inputs, "inductor", dynamic_dims=(0, 1))
    token = torch.randn(1, 1, 96, generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        for x in inputs + [token]:
            assert torch.equal(packed(x), canonical(x))
        assert torch.equal(torch.compile(packed, fullgraph=True)(token), canonical(token))


def test_fully_shard_check_names_a_packed_weight_and_the_remedy():
    from qtensor.distributed.fsdp import shard_problems

    packed, canonical = _models(CONFIGS["nvfp4"])
    assert shard_problems(canonical, 2) == []
    problems = shard_problems(packed, 2)
    assert len(problems) == 2 and problems[0].startswith("0.weight (DecodeWeight")
    assert "layout='canonical'" in problems[0] and "weight.canonical()" in problems[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_canonical_is_bitwise_the_packed_source(name):
    packed, canonical = _models(CONFIGS[name])
    for i in (0, 2):
        got, want = packed[i].weight.canonical(), canonical[i].weight
        assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
        assert got.fields().keys() == want.fields().keys()
        for n in want.tensor_data_names:
            a, b = getattr(got, n), getattr(want, n)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        for n in want.tensor_attribute_names:
            assert getattr(got, n) == getattr(want, n)
        assert torch.equal(packed[i].weight.dequantize(), want.dequantize())


def test_repr_names_the_layout():
    packed, _ = _models(CONFIGS["nvfp4"])
    r = repr(packed[0].weight)
    assert "packing=decode-v3" in r and "canonical=NVFP4Tensor" in r and "fmt=nvfp4" in r
    assert "DecodeWeight" in repr(packed)


def _files(model, tmp_path, tag):
    """Every file format's bytes for the model's state_dict."""
    out = {}
    p = tmp_path / f"{tag}.safetensors"
    qtensor.save_file(model.state_dict(), p)
    out["safetensors"] = p.read_bytes()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    out["torch.save"] = buf.getvalue()
    buf = io.BytesIO()
    torch.save({"w": model[0].weight}, buf)  # the tensor itself, outside any state_dict
    out["torch.save tensor"] = buf.getvalue()
    return out


@pytest.mark.parametrize("name", ["nvfp4_rowscaled_b256", "mxfp8", "mxfp4"])
def test_checkpoints_of_packed_and_canonical_models_are_identical(name, tmp_path):
    packed, canonical = _models(CONFIGS[name])
    a, b = _files(packed, tmp_path, "packed"), _files(canonical, tmp_path, "canonical")
    for kind in a:
        assert a[kind] == b[kind], kind


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_loading_packs_again(name, tmp_path):
    packed, canonical = _models(CONFIGS[name], seed=1)
    other, _ = _models(CONFIGS[name], seed=2)  # packed, other bytes
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert not torch.equal(other(x), canonical(x))
    p = tmp_path / "m.safetensors"
    qtensor.save_file(canonical.state_dict(), p)
    sd_io.load_state_dict(other, qtensor.load_file(p))
    assert isinstance(other[0].weight, DecodeWeight)
    assert torch.equal(other(x), canonical(x))
    # torch.load of a torch.save of the packed tensor gives the canonical tensor.
    buf = io.BytesIO()
    torch.save(packed[0].weight, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back) is type(canonical[0].weight)
    assert torch.equal(back.dequantize(), canonical[0].weight.dequantize())


def test_a_file_naming_the_serving_class_is_refused(tmp_path):
    from qtensor.checkpoint import schema

    packed, _ = _models(CONFIGS["nvfp4"])
    entry, _ = schema.encode("w", packed[0].weight)
    assert entry["class"] == "NVFP4Tensor"  # the canonical tensor is what is stored
    entry["class"] = "DecodeWeight"
    with pytest.raises(schema.CheckpointError, match="must be one of"):
        schema.decode("w", entry, lambda name, shape, dtype: None)


def test_ops_outside_the_layout_raise_with_the_remedy():
    packed, _ = _models(CONFIGS["nvfp4"])
    w = packed[0].weight
    with pytest.raises(NotImplementedError, match="does not implement"):
        w.t()
    with pytest.raises(NotImplementedError, match="canonical"):
        w.shard_dims()
    with pytest.raises(TypeError, match="high-precision float activation"):
        packed[0](NVFP4Tensor.from_hp(torch.randn(4, 96)))
    with pytest.raises(ValueError, match="takes K = 96"):
        torch.nn.functional.linear(torch.randn(2, 64, dtype=torch.bfloat16), w)


def test_pack_refuses_what_the_layout_cannot_hold():
    dyn = NVFP4Tensor.from_hp(torch.randn(64, 64)).replace(act_spec=NVFP4Spec())
    with pytest.raises(ValueError, match="dynamic-activation"):
        DecodeWeight.pack(dyn)
    with pytest.raises(ValueError, match="rowwise"):
        DecodeWeight.pack(NVFP4Tensor.from_hp(torch.randn(64, 64), columnwise=True))
    with pytest.raises(ValueError, match="NaN codes"):
        DecodeWeight.pack(MXFP8Tensor.from_hp(torch.full((64, 64), float("nan")),
                                              check_finite=False))
    lin = nn.Linear(64, 64)
    assert to_decode_layout(lin) is False  # a high-precision weight stays as it is


def test_gradient_reaches_the_activation_and_bias():
    packed, canonical = _models(CONFIGS["mxfp8"])
    for m in (packed, canonical):
        m.float()
        m[0].bias.requires_grad_(True)
    x1 = torch.randn(4, 96, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    packed(x1).square().sum().backward()
    canonical(x2).square().sum().backward()
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(packed[0].bias.grad, canonical[0].bias.grad, rtol=1e-5, atol=1e-6)


def test_auto_layout_packs_only_where_the_kernel_runs():
    from qtensor.ops.decode_mm import device_kernel_problem

    m = nn.Linear(64, 64).bfloat16()
    quantize_(m, NVFP4WeightOnlyConfig())  # layout "auto", on the CPU: no kernel here
    assert device_kernel_problem(torch.device("cpu"), "nvfp4") is not None
    assert not isinstance(m.weight, DecodeWeight)
    with pytest.raises(ValueError, match="layout is"):
        NVFP4WeightOnlyConfig(layout="tiled")


def test_mxfp4_weight_only_config_both_entry_points():
    from torchao.quantization import quantize_ as ao_quantize_

    torch.manual_seed(3)
    w = torch.randn(64, 128)
    ours, theirs = nn.Linear(128, 64, bias=False), nn.Linear(128, 64, bias=False)
    ours.weight.data.copy_(w)
    theirs.weight.data.copy_(w)
    quantize_(ours, MXFP4WeightOnlyConfig(layout="canonical"))
    ao_quantize_(theirs, MXFP4WeightOnlyConfig(layout="canonical"))
    want = MXFP4Tensor.from_hp(w)
    for m in (ours, theirs):
        assert isinstance(m.weight, MXFP4Tensor)
        assert torch.equal(m.weight.qdata, want.qdata) and torch.equal(m.weight.scale, want.scale)
    with pytest.raises(ValueError, match="MXFP4 needs in_features divisible by 32"):
        quantize_(nn.Linear(48, 64), MXFP4WeightOnlyConfig())
