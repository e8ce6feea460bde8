"""Bad specs and configs are refused at construction, and quantize_'s errors name the layer
and give a remedy the user can apply (each case was accepted, or failed later and elsewhere,
before)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qtensor
from qtensor import MXFP8Spec, NVFP4Spec, qat


@pytest.mark.parametrize("make, match", [
    (lambda: NVFP4Spec(block_2d=1), r"NVFP4Spec.block_2d must be a bool .*got 1 \(int\)"),
    (lambda: NVFP4Spec(row_scaled="no"), r"NVFP4Spec.row_scaled must be a bool"),
    (lambda: NVFP4Spec(e4m3_bound=256.0), r"NVFP4Spec.e4m3_bound must be an int; got 256.0"),
    (lambda: NVFP4Spec(e4m3_bound=True), r"NVFP4Spec.e4m3_bound must be an int"),
    (lambda: MXFP8Spec(columnwise=0), r"MXFP8Spec.columnwise must be a bool"),
    (lambda: qtensor.NVFP4WeightOnlyConfig(skip_incompatible="yes"),
     r"NVFP4WeightOnlyConfig.skip_incompatible must be a bool"),
    (lambda: qat.MXFP4QATConfig(direct=1), r"MXFP4QATConfig.direct must be a bool"),
])
def test_spec_and_config_fields_have_their_declared_types(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_a_valid_spec_round_trips_through_a_checkpoint(tmp_path):
    """The spec a file records is the spec it was made with: bools stay bools."""
    from qtensor.checkpoint.safetensors import load_file, save_file

    t = qtensor.NVFP4Tensor.from_hp(torch.randn(32, 64), block_2d=True)
    save_file({"w": t}, tmp_path / "w.safetensors")
    back = load_file(tmp_path / "w.safetensors")["w"]
    assert back.block_2d is True and torch.equal(back.qdata, t.qdata)


def test_quantize_twice_names_the_layer():
    model = nn.Sequential(nn.Linear(64, 64))
    qtensor.quantize_(model, qtensor.NVFP4WeightOnlyConfig())
    with pytest.raises(TypeError, match=r"layer '0' is already quantized \(NVFP4Tensor\)"):
        qtensor.quantize_(model, qtensor.NVFP4WeightOnlyConfig())


def test_a_config_class_instead_of_an_instance():
    with pytest.raises(TypeError, match=r"a config instance; got the class "
                                        r"MXFP8WeightOnlyConfig. Pass MXFP8WeightOnlyConfig\(\)"):
        qtensor.quantize_(nn.Sequential(nn.Linear(64, 64)), qtensor.MXFP8WeightOnlyConfig)


@pytest.mark.parametrize("config", [qtensor.NVFP4WeightOnlyConfig(),
                                    qtensor.MXFP8DynamicActivationMXFP8WeightConfig()])
def test_a_nan_weight_names_its_layer_and_a_reachable_remedy(config):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"layer '2': the weight has 1 non-finite value\(s\).*"
                                         r"filter_fn.*check_finite=False \(NVFP4Tensor.from_hp"):
        qtensor.quantize_(model, config)


def test_quantizing_a_tied_weight_says_it_unties_it():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(128, 64)
            self.head = nn.Linear(64, 128, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    with pytest.warns(UserWarning, match=r"layer 'head'.s weight is tied to \['embed.weight'\]"):
        qtensor.quantize_(model, qtensor.NVFP4WeightOnlyConfig())
    assert isinstance(model.head.weight, qtensor.NVFP4Tensor)
    assert not isinstance(model.embed.weight, qtensor.NVFP4Tensor)


def test_a_meta_model_quantized_then_materialized_loads_a_checkpoint():
    """Module.to_empty on quantized meta weights (empty_like keeps layout and metadata), then
    load_state_dict fills the bytes."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 32))
    qtensor.quantize_(model, qtensor.NVFP4WeightOnlyConfig(NVFP4Spec(row_scaled=True)))
    model.to_empty(device="cpu")
    assert model[0].weight.qdata.device.type == "cpu" and model[0].weight.row_scaled
    src = qtensor.quantize_(nn.Sequential(nn.Linear(64, 32)),
                            qtensor.NVFP4WeightOnlyConfig(NVFP4Spec(row_scaled=True)))
    model.load_state_dict(src.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(model(x), src(x))


def test_a_float64_activation_is_refused_by_the_gemm_op():
    model = qtensor.quantize_(nn.Sequential(nn.Linear(64, 32)), qtensor.NVFP4WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"qtensor::nvfp4_mm: .*float32, bfloat16 or float16; "
                                         r"got torch.float64"):
        model(torch.randn(2, 64, dtype=torch.float64))


def test_a_second_quantization_says_what_happened():
    """torchao's quantize_ on a qtensor-quantized model reaches an op the quantized weight does
    not implement: the error names the op and says to quantize the high-precision model."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization import quantize_ as torchao_quantize_

    model = qtensor.quantize_(nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16),
                              qtensor.NVFP4WeightOnlyConfig())
    with pytest.raises(NotImplementedError, match=r"NVFP4Tensor does not implement aten\..*"
                                                  r"Quantizing an already quantized model"):
        torchao_quantize_(model, Int8WeightOnlyConfig())
