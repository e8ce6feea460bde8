"""Export for serving engines, checked with readers nobody here wrote: ml_dtypes' element codecs
(always), compressed-tensors' NVFP4 decompressor and transformers' gpt-oss MXFP4 converter (when
installed; both are heavy, so they are not in the test extra)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import qtensor
from qtensor.checkpoint import CheckpointError
from qtensor.checkpoint.export import export_mxfp4, export_nvfp4
from qtensor.formats import NVFP4Spec, mxfp4

ml_dtypes = pytest.importorskip("ml_dtypes")

SPECS = {"plain": NVFP4Spec(), "4over6_b256": NVFP4Spec(fourover6="mae", e4m3_bound=256),
         "2d": NVFP4Spec(block_2d=True)}


def nvfp4_model(spec, act=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 8))
    m = m.to(torch.bfloat16)
    with torch.no_grad():
        m[0].weight[3, 5] = 40.0  # an outlier, so the global amax matters
    cfg = (qtensor.NVFP4WeightOnlyConfig(weight=spec) if act is None else
           qtensor.NVFP4DynamicActivationNVFP4WeightConfig(weight=spec, activation=act))
    # The last layer stays high precision: the export must list it under "ignore".
    qtensor.quantize_(m, cfg, filter_fn=lambda mod, name: name != "3")
    return m


def _e2m1(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _unpack(packed: torch.Tensor) -> np.ndarray:
    """Nibbles to codes with numpy, element 2j from the low nibble (the layouts' convention)."""
    p = packed.numpy()
    return np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


@pytest.mark.parametrize("which", list(SPECS))
def test_nvfp4_export_decodes_with_ml_dtypes(tmp_path, which):
    model = nvfp4_model(SPECS[which])
    cfg = export_nvfp4(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    q = cfg["quantization_config"]
    assert q["format"] == "nvfp4-pack-quantized" and q["ignore"] == ["3"]
    assert "3.weight" in sd and "0.bias" in sd and "0.weight" not in sd
    for name in ("0", "2"):
        w = model[int(name)].weight
        assert sd[f"{name}.weight_packed"].dtype == torch.uint8
        assert torch.equal(sd[f"{name}.weight_scale"].view(torch.uint8), w.scale.view(torch.uint8))
        vals = _e2m1(_unpack(sd[f"{name}.weight_packed"]))
        scale = sd[f"{name}.weight_scale"].view(torch.uint8).numpy().view(
            ml_dtypes.float8_e4m3fn).astype(np.float32)
        units = vals.reshape(*scale.shape, 16) * scale[..., None]  # exact products
        assert torch.equal(torch.from_numpy(units.reshape(vals.shape)), w.unit_values())
        # The global scale is the encode scale: the reader's s_b / g is qtensor's decode factor
        # A / (6 B) (bound absorbed) up to the last bit of rounding.
        g = sd[f"{name}.weight_global_scale"].numpy()
        decoded = torch.from_numpy(vals.reshape(*scale.shape, 16) * (scale / g)[..., None])
        ours = w.dequantize(torch.float32).reshape(decoded.shape)
        torch.testing.assert_close(decoded, ours, rtol=2**-22, atol=0)


def test_4over6_bound_256_global_scale_absorbs_the_bound(tmp_path):
    model = nvfp4_model(SPECS["4over6_b256"])
    export_nvfp4(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    w = model[0].weight
    g = sd["0.weight_global_scale"].item()
    assert g == pytest.approx(6 * 256 / w.amax.item(), rel=2**-23)  # not 6 * 448 / amax
    # A reader that assumed 6 * 448 would decode the outlier (40, the tensor's amax, map-to-6
    # code 6 with block scale 256) as 40 * 256 / 448; with the bound absorbed it reads 40.
    s_b = sd["0.weight_scale"][3, 0].float().item()
    code = sd["0.weight_packed"][3, 2].item() >> 4  # element 5: high nibble of byte 2
    assert (s_b, code) == (256.0, 7)
    assert 6.0 * (s_b / g) == pytest.approx(40.0, rel=2**-22)  # 1536 / 40 is inexact in fp32


def test_nvfp4_activation_scale_and_errors(tmp_path):
    act = NVFP4Spec(fourover6="mse", e4m3_bound=256)
    model = nvfp4_model(SPECS["plain"], act=act)
    with pytest.raises(CheckpointError, match="'0'.*input_amax"):
        export_nvfp4(model, tmp_path)
    amax = {"0": torch.tensor(3.0), "2": torch.tensor(0.5)}
    cfg = export_nvfp4(model, tmp_path, input_amax=amax)
    sd = load_file(tmp_path / "model.safetensors")
    assert sd["2.input_global_scale"].item() == 6 * 256 / 0.5  # the activation's own bound
    assert cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"][
        "dynamic"] == "local"
    export_nvfp4(model, tmp_path, weight_only=True)
    assert "0.input_global_scale" not in load_file(tmp_path / "model.safetensors")
    rowscaled = nvfp4_model(NVFP4Spec(row_scaled=True))
    with pytest.raises(CheckpointError, match="'0'.*row_scaled=True"):
        export_nvfp4(rowscaled, tmp_path)


def test_row_scaled_activations_export_with_calibrated_amax(tmp_path):
    """The remedy the error names works: calibrate_input_amax measures each quantized layer's
    input amax over a few batches, and export_nvfp4 takes it (one static scale per layer)."""
    from qtensor.checkpoint import calibrate_input_amax
    from qtensor.formats.nvfp4 import encode_scale

    model = nvfp4_model(SPECS["plain"], act=NVFP4Spec(row_scaled=True))
    with pytest.raises(CheckpointError, match=r"'0'.*one amax per row.*calibrate_input_amax"):
        export_nvfp4(model, tmp_path)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(8, 256, generator=gen).bfloat16() * s for s in (1.0, 3.0)]
    amax = calibrate_input_amax(model, batches)
    assert sorted(amax) == ["0", "2"]  # the bf16 layer "3" quantizes nothing
    assert amax["0"].item() == max(b.float().abs().max().item() for b in batches)
    export_nvfp4(model, tmp_path, input_amax=amax)
    sd = load_file(tmp_path / "model.safetensors")
    want, _ = encode_scale(amax["2"], 448)
    assert sd["2.input_global_scale"].item() == want.item()
    with pytest.raises(ValueError, match="no nn.Linear named"):
        calibrate_input_amax(model, batches, layers=["9"])


class Experts(nn.Module):
    """gpt-oss style expert weights: the parameter [E, K, N] is the right operand of x @ W; the
    checkpoint stores it [E, N, K], blocked along K."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4, 64, 96, generator=g) * torch.logspace(-3, 2, 96)  # [E, N, K]
        self.gate_up_proj = nn.Parameter(w.transpose(1, 2).contiguous().to(torch.bfloat16))
        self.router = nn.Linear(96, 4)

    def stored(self) -> torch.Tensor:
        """The parameter as the checkpoint holds it, [E, N, K]."""
        return self.gate_up_proj.detach().float().transpose(1, 2)


def test_mxfp4_export_decodes_with_ml_dtypes(tmp_path):
    model = Experts()
    cfg = export_mxfp4(model, tmp_path, select=lambda k, t: k == "gate_up_proj")
    assert cfg["quantization_config"] == {"quant_method": "mxfp4",
                                          "modules_to_not_convert": ["router"]}
    sd = load_file(tmp_path / "model.safetensors")
    blocks, scales = sd["gate_up_proj_blocks"], sd["gate_up_proj_scales"]
    assert blocks.shape == (4, 64, 3, 16) and scales.shape == (4, 64, 3)
    vals = _e2m1(_unpack(blocks))  # [E, N, K/32, 32]
    s = scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    decoded = torch.from_numpy((vals * s[..., None]).reshape(4, 64, 96))
    want = mxfp4.fake_quantize_values(model.stored())
    assert torch.equal(decoded, want)


def test_mxfp4_export_refuses_quantized_and_nonfinite(tmp_path):
    model = Experts()
    with torch.no_grad():
        model.gate_up_proj[0, 0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="gate_up_proj.*finite"):
        export_mxfp4(model, tmp_path, select=lambda k, t: k == "gate_up_proj")
    with pytest.raises(CheckpointError, match="picked no parameter"):
        export_mxfp4(model, tmp_path, select=lambda k, t: False)


# ---- third-party readers (heavy; run where installed) ---------------------------------------


@pytest.mark.parametrize("which", list(SPECS))
def test_nvfp4_export_with_compressed_tensors(tmp_path, which):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    model = nvfp4_model(SPECS[which])
    cfg = export_nvfp4(model, tmp_path)
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"],
                                weights=QuantizationArgs(**group["weights"]))
    sd = load_file(tmp_path / "model.safetensors")
    for name in ("0", "2"):
        sub = {k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(f"{name}.weight")}
        got = NVFP4PackedCompressor.decompress(sub, scheme)["weight"]
        w = model[int(name)].weight
        assert torch.equal(got, w.dequantize(got.dtype)), (ct.__version__, name)


def test_mxfp4_export_with_transformers_gpt_oss_reader(tmp_path):
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = Experts()
    export_mxfp4(model, tmp_path, select=lambda k, t: k == "gate_up_proj")
    sd = load_file(tmp_path / "model.safetensors")
    got = convert_moe_packed_tensors(sd["gate_up_proj_blocks"], sd["gate_up_proj_scales"],
                                     dtype=torch.float32)
    want = mxfp4.fake_quantize_values(model.stored())
    assert torch.equal(got, want.transpose(1, 2))  # back in the parameter's [E, K, N]
