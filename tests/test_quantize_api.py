"""quantize_(model, config) through qtensor.quantize_ and torchao.quantization.quantize_, for every
config: same outputs from both entry points, SQNR floors against the bf16 model, shape errors
naming the layer and the rule, skip_incompatible, filter_fn, and config validation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qtensor
from conftest import sqnr_db
from qtensor import (
    MXFP8DynamicActivationMXFP8WeightConfig,
    MXFP8Spec,
    MXFP8Tensor,
    MXFP8WeightOnlyConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4Spec,
    NVFP4Tensor,
    NVFP4WeightOnlyConfig,
)
from qtensor.cli.models import DemoConfig, build_demo_model, demo_tokens

SMALL = DemoConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=160)

# config -> (config object, SQNR floor in dB of the logits vs the bf16 model). Floors are the
# values measured on the CPU (this model and seed) minus about 2 dB:
# 18.2, 16.7, 14.8, 14.9, 15.7, 28.7, 25.4, 24.7.
CONFIGS = {
    "nvfp4_weight_only": (NVFP4WeightOnlyConfig(), 16.0),
    "nvfp4_weight_only_2d_4o6": (
        NVFP4WeightOnlyConfig(weight=NVFP4Spec(block_2d=True, fourover6="mse", e4m3_bound=256)),
        14.5,
    ),
    "nvfp4_dynamic": (NVFP4DynamicActivationNVFP4WeightConfig(), 12.5),
    "nvfp4_dynamic_row_scaled": (
        NVFP4DynamicActivationNVFP4WeightConfig(activation=NVFP4Spec(row_scaled=True)),
        12.5,
    ),
    "nvfp4_dynamic_4o6": (
        NVFP4DynamicActivationNVFP4WeightConfig(
            weight=NVFP4Spec(fourover6="mae", e4m3_bound=256),
            activation=NVFP4Spec(fourover6="mae", e4m3_bound=256),
        ),
        13.5,
    ),
    "mxfp8_weight_only": (MXFP8WeightOnlyConfig(), 26.5),
    "mxfp8_dynamic": (MXFP8DynamicActivationMXFP8WeightConfig(), 23.0),
    "mxfp8_dynamic_floor": (
        MXFP8DynamicActivationMXFP8WeightConfig(
            weight=MXFP8Spec("floor"), activation=MXFP8Spec("floor")
        ),
        22.5,
    ),
}


@pytest.fixture(scope="module")
def model_and_reference():
    model = build_demo_model(SMALL, seed=0)
    tokens = demo_tokens(SMALL, 2, 16)
    with torch.no_grad():
        return model, tokens, model(tokens)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_both_entry_points_agree_and_meet_the_sqnr_floor(model_and_reference, name):
    from torchao.quantization import quantize_ as torchao_quantize_

    model, tokens, ref = model_and_reference
    config, floor = CONFIGS[name]
    ours = qtensor.quantize_(copy.deepcopy(model), config)
    theirs = copy.deepcopy(model)
    torchao_quantize_(theirs, config)
    weight_spec, act_spec = config.specs()
    cls = NVFP4Tensor if isinstance(weight_spec, NVFP4Spec) else MXFP8Tensor
    linears = [m for m in ours.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per block + lm_head
    for m in linears:
        assert type(m.weight) is cls and m.weight.act_spec == act_spec
        assert not m.weight.requires_grad
    with torch.no_grad():
        out_ours, out_theirs = ours(tokens), theirs(tokens)
    assert out_ours.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out_ours, out_theirs)
    assert sqnr_db(ref, out_ours) > floor


def _odd_model():
    # layer "1" has in_features 40 (not a multiple of 16 or 32); layer "0" has out_features 40
    return nn.Sequential(nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 64), nn.Linear(64, 96))


@pytest.mark.parametrize(
    "config,message",
    [
        (NVFP4WeightOnlyConfig(), r"NVFP4 needs in_features divisible by 16; got 40 at layer '2'"),
        (MXFP8DynamicActivationMXFP8WeightConfig(),
         r"MXFP8 needs in_features divisible by 32; got 40 at layer '2'"),
        (NVFP4WeightOnlyConfig(weight=NVFP4Spec(block_2d=True)),
         r"NVFP4 2D blocks need out_features divisible by 16; got 40 at layer '0'"),
    ],
)
def test_shape_errors_name_the_layer_and_the_rule(config, message):
    with pytest.raises(ValueError, match=message + r".*filter_fn.*skip_incompatible=True"):
        qtensor.quantize_(_odd_model(), config)


def test_shape_error_through_torchao_names_the_rule():
    from torchao.quantization import quantize_ as torchao_quantize_

    with pytest.raises(ValueError, match=r"in_features divisible by 16; got 40 at layer"):
        torchao_quantize_(_odd_model(), NVFP4WeightOnlyConfig())


@pytest.mark.parametrize("quantize", ["qtensor", "torchao"])
def test_skip_incompatible_leaves_those_layers_in_high_precision(quantize):
    from torchao.quantization import quantize_ as torchao_quantize_

    model = _odd_model()
    x = torch.randn(3, 64)
    config = NVFP4WeightOnlyConfig(skip_incompatible=True)
    (qtensor.quantize_ if quantize == "qtensor" else torchao_quantize_)(model, config)
    assert isinstance(model[0].weight, NVFP4Tensor)
    assert type(model[2].weight) is nn.Parameter  # in_features 40: skipped
    assert isinstance(model[3].weight, NVFP4Tensor)
    assert model(x).shape == (3, 96)


def test_filter_fn_selects_layers(model_and_reference):
    model, tokens, _ = model_and_reference
    m = copy.deepcopy(model)
    qtensor.quantize_(m, MXFP8WeightOnlyConfig(), filter_fn=lambda mod, name: "mlp" in name)
    for name, mod in m.named_modules():
        if isinstance(mod, nn.Linear):
            assert isinstance(mod.weight, MXFP8Tensor) == ("mlp" in name), name
    assert any("mlp" in n for n, _ in m.named_modules())
    with torch.no_grad():
        assert m(tokens).shape == (2, 16, SMALL.vocab_size)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: NVFP4WeightOnlyConfig(weight=NVFP4Spec(columnwise=True)),
         "weight spec must be rowwise"),
        (lambda: NVFP4DynamicActivationNVFP4WeightConfig(
            activation=NVFP4Spec(stochastic_rounding=True)),
         "gradient .*options; the activation spec"),
        (lambda: NVFP4DynamicActivationNVFP4WeightConfig(activation=NVFP4Spec(block_2d=True)),
         r"2D \(16x16\) blocks are for weights"),
        (lambda: MXFP8DynamicActivationMXFP8WeightConfig(activation=MXFP8Spec(columnwise=True)),
         "activation spec must be rowwise"),
    ],
)
def test_config_validation(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_quantize_rejects_other_configs():
    from torchao.quantization import Int8WeightOnlyConfig

    with pytest.raises(TypeError, match="quantize_ takes one of NVFP4WeightOnlyConfig.*got "
                                        "Int8WeightOnlyConfig"):
        qtensor.quantize_(nn.Sequential(nn.Linear(64, 64)), Int8WeightOnlyConfig())


@pytest.mark.parametrize(
    "make",
    [
        lambda: NVFP4WeightOnlyConfig(weight=MXFP8Spec()),
        lambda: NVFP4DynamicActivationNVFP4WeightConfig(activation=MXFP8Spec()),
        lambda: MXFP8WeightOnlyConfig(weight=NVFP4Spec()),
        lambda: MXFP8DynamicActivationMXFP8WeightConfig(activation=NVFP4Spec()),
    ],
)
def test_config_refuses_a_spec_of_the_other_format(make):
    with pytest.raises(TypeError, match=r"takes an (NVFP4|MXFP8)Spec; got (MXFP8|NVFP4)Spec"):
        make()
