"""qtensor.from_pretrained on published NVFP4 layouts ([Note: reading NVFP4 checkpoints]).

The compressed-tensors checkpoints are written by compressed-tensors' own code (its
quantization config, its scale helpers and its ModelCompressor), and the reference is its own
decompression, loaded by transformers. The ModelOpt checkpoint is the same bytes laid out as
ModelOpt documents (hf_quant_config.json, weight / weight_scale / weight_scale_2 / input_scale),
checked against ModelOpt's documented decode, value(q) * s_b * weight_scale_2.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import qtensor
from qtensor import NVFP4Spec, NVFP4Tensor
from qtensor.checkpoint import CheckpointError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def write_compressed_tensors(base, out, inputs: bool = False):
    """A compressed NVFP4 checkpoint of `base`, made by compressed-tensors itself."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    wargs = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                             symmetric=True, dynamic=False)
    aargs = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                             symmetric=True, dynamic="local") if inputs else None
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    for module in model.modules():
        if not hasattr(module, "weight_global_scale"):
            continue
        w = module.weight.float()
        module.weight_global_scale.data.copy_(generate_gparam(w.min(), w.max()).reshape(1))
        groups = w.reshape(w.shape[0], -1, 16)
        s, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), wargs,
                                 global_scale=module.weight_global_scale)
        module.weight_scale.data.copy_(s.reshape(module.weight_scale.shape))
        if inputs:
            module.input_global_scale.data.copy_(generate_gparam(-4.0 * torch.ones(()),
                                                                 4.0 * torch.ones(())).reshape(1))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


@pytest.fixture(scope="module")
def ct_dir(base_dir, tmp_path_factory):
    return write_compressed_tensors(base_dir, tmp_path_factory.mktemp("ct"))


def ct_decompressed(d):
    """compressed-tensors' own decompression, as transformers loads it: a bf16 model."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))


def tokens():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def test_compressed_tensors_checkpoint_runs_its_bytes(ct_dir):
    model = qtensor.from_pretrained(ct_dir)
    ref = ct_decompressed(ct_dir)
    stored = safetensors_torch.load_file(ct_dir / "model.safetensors")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 15 and linears[-1] == "lm_head"
    for name in linears[:-1]:
        w = model.get_submodule(name).weight
        assert type(w) is NVFP4Tensor and w.act_spec is None, name
        assert torch.equal(w.qdata, stored[f"{name}.weight_packed"]), name
        assert torch.equal(w.scale.view(torch.uint8),
                           stored[f"{name}.weight_scale"].view(torch.uint8)), name
        s_enc = stored[f"{name}.weight_global_scale"].reshape(())
        assert torch.equal(w.amax, torch.tensor(2688.0) / s_enc), name
        # The bf16 weights compressed-tensors decompresses to are qtensor's decode, rounded.
        assert torch.equal(w.dequantize(torch.bfloat16), ref.get_submodule(name).weight), name
    assert not isinstance(model.lm_head.weight, NVFP4Tensor)
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    with torch.no_grad():
        got, want = model(tokens()).logits.float(), ref(tokens()).logits.float()
    # The reference multiplies bf16-rounded weights; qtensor their exact values in fp32.
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    out = model.generate(tokens()[:1, :4], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


def test_w4a4_checkpoint_needs_an_activation_choice(base_dir, tmp_path):
    d = write_compressed_tensors(base_dir, tmp_path / "w4a4", inputs=True)
    with pytest.raises(CheckpointError, match="static activation scales .*activations='dynamic'"):
        qtensor.from_pretrained(d)
    dynamic = qtensor.from_pretrained(d, activations="dynamic")
    weight_only = qtensor.from_pretrained(d, activations="none")
    assert dynamic.get_submodule(LAYER).weight.act_spec == NVFP4Spec()
    assert weight_only.get_submodule(LAYER).weight.act_spec is None
    with torch.no_grad():
        a, b = dynamic(tokens()).logits, weight_only(tokens()).logits
    assert not torch.equal(a, b) and torch.isfinite(a).all()
    with pytest.raises(ValueError, match="activations must be one of"):
        qtensor.from_pretrained(d, activations="static")


def to_modelopt(ct_dir, out):
    """The checkpoint's bytes in ModelOpt's layout: weight_scale_2 = 1 / S_enc."""
    shutil.copytree(ct_dir, out)
    sd = safetensors_torch.load_file(out / "model.safetensors")
    new = {}
    for k, v in sd.items():
        if k.endswith(".weight_packed"):
            new[k.replace(".weight_packed", ".weight")] = v
        elif k.endswith(".weight_global_scale"):
            new[k.replace(".weight_global_scale", ".weight_scale_2")] = (1.0 / v).reshape(())
            new[k.replace(".weight_global_scale", ".input_scale")] = torch.tensor(4.0 / 2688)
        else:
            new[k] = v
    safetensors_torch.save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.0"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                         "exclude_modules": ["lm_head"], "kv_cache_quant_algo": None}}))
    return out


def test_modelopt_checkpoint_decodes_as_modelopt_documents(ct_dir, tmp_path):
    d = to_modelopt(ct_dir, tmp_path / "modelopt")
    with pytest.raises(CheckpointError, match="static activation scales"):
        qtensor.from_pretrained(d)
    model = qtensor.from_pretrained(d, activations="none")
    stored = safetensors_torch.load_file(d / "model.safetensors")
    w = model.get_submodule(LAYER).weight
    assert torch.equal(w.qdata, stored[f"{LAYER}.weight"])
    # ModelOpt's decode: E2M1 value of each nibble (low nibble first) * s_b * weight_scale_2.
    packed = stored[f"{LAYER}.weight"].long()
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    factor = stored[f"{LAYER}.weight_scale"].float() * stored[f"{LAYER}.weight_scale_2"]
    want = (values.reshape(values.shape[0], -1, 16) * factor[..., None]).reshape(values.shape)
    got = w.dequantize(torch.float32)
    # Two roundings of the per-tensor factor (weight_scale_2 = r(1 / S_enc) here, then qtensor's
    # A = r(weight_scale_2 * 2688) and r(r(s_b A) r(1 / 2688))) against one in ModelOpt's
    # product: at most 2 fp32 ulps apart, and the bf16 values agree.
    ulps = (got.view(torch.int32) - want.view(torch.int32)).abs()
    assert ulps.max() <= 2
    assert (got.bfloat16() != want.bfloat16()).float().mean() < 1e-3


def _rewrite(src, dst, change_tensors=None, change_config=None):
    shutil.copytree(src, dst)
    if change_tensors:
        sd = safetensors_torch.load_file(dst / "model.safetensors")
        change_tensors(sd)
        safetensors_torch.save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    if change_config:
        cfg = json.loads((dst / "config.json").read_text())
        change_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set_format(qc, fmt):
    qc["format"] = fmt
    qc["config_groups"]["group_0"]["format"] = fmt


@pytest.mark.parametrize("case, tensors, config, match", [
    ("format", None, lambda qc: _set_format(qc, "float-quantized"),
     "format 'float-quantized'; qtensor reads 'nvfp4-pack-quantized'"),
    ("group size", None,
     lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=32),
     "weights are not NVFP4 .*'group_size': 32"),
    ("scale dtype", lambda sd: sd.update({f"{LAYER}.weight_scale":
                                          sd[f"{LAYER}.weight_scale"].bfloat16()}), None,
     rf"'{LAYER}.weight_scale': must be F8_E4M3 \[64, 4\].* got BF16"),
    ("scale shape", lambda sd: sd.update({f"{LAYER}.weight_scale":
                                          sd[f"{LAYER}.weight_scale"][:, :2].contiguous()}),
     None, rf"'{LAYER}.weight_scale': must be F8_E4M3 \[64, 4\].* got F8_E4M3 \[64, 2\]"),
    ("missing global scale", lambda sd: sd.pop(f"{LAYER}.weight_global_scale"), None,
     rf"'{LAYER}.weight_global_scale': missing"),
    ("zero global scale", lambda sd: sd[f"{LAYER}.weight_global_scale"].zero_(), None,
     "must be finite and positive; got 0.0"),
    ("layer lacks its weights", lambda sd: [sd.pop(f"{LAYER}.{k}") for k in
                                            ("weight_packed", "weight_scale",
                                             "weight_global_scale")], None,
     rf"'{LAYER}': the config quantizes this layer, but the checkpoint has no NVFP4 tensors"),
    ("ignored layer stored quantized", None, lambda qc: qc["ignore"].append(LAYER),
     rf"the config does not quantize '{LAYER}'"),
    ("stray tensor", lambda sd: sd.update({"model.extra": torch.zeros(2)}), None,
     r"tensors the model has no place for: \['model.extra'\]"),
])
def test_malformed_checkpoints_are_refused_naming_the_tensor(ct_dir, tmp_path, case, tensors,
                                                            config, match):
    d = _rewrite(ct_dir, tmp_path / "bad", tensors, config)
    with pytest.raises(CheckpointError, match=match):
        qtensor.from_pretrained(d)


def test_a_checkpoint_without_quantization_is_refused(base_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no quantized checkpoint qtensor reads"):
        qtensor.from_pretrained(base_dir)
    with pytest.raises(CheckpointError, match="has no config.json"):
        qtensor.from_pretrained(tmp_path)


def test_sharded_checkpoint_loads_like_the_single_file(ct_dir, tmp_path):
    d = shutil.copytree(ct_dir, tmp_path / "sharded")
    sd = safetensors_torch.load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, names in shards.items():
        safetensors_torch.save_file({k: sd[k] for k in names}, d / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    single, sharded = qtensor.from_pretrained(ct_dir), qtensor.from_pretrained(d)
    with torch.no_grad():
        assert torch.equal(single(tokens()).logits, sharded(tokens()).logits)
    index["weight_map"][keys[0]] = "model-00003-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00003-of-00002.safetensors, which is not in"):
        qtensor.from_pretrained(d)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpoint_loads_onto_cuda_and_matches_the_cpu_model(base_dir, tmp_path):
    """An NVFP4 checkpoint (the compressed-tensors layout, written by export_nvfp4) loaded onto
    the GPU: the same bytes as on the CPU, the rotary buffers rebuilt there, the Triton GEMMs
    equal to the CPU reference up to fp32 summation order."""
    from transformers import AutoModelForCausalLM

    from qtensor.checkpoint import export_nvfp4

    src = qtensor.quantize_(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16),
                            qtensor.NVFP4WeightOnlyConfig(),
                            filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head")
    export_nvfp4(src, tmp_path / "ckpt", config=src.config.to_dict())
    cpu = qtensor.from_pretrained(tmp_path / "ckpt")
    gpu = qtensor.from_pretrained(tmp_path / "ckpt", device="cuda")
    w_cpu, w_gpu = cpu.get_submodule(LAYER).weight, gpu.get_submodule(LAYER).weight
    assert w_gpu.device.type == "cuda" and w_gpu.gemm_backend == "triton"
    assert torch.equal(w_gpu.qdata.cpu(), w_cpu.qdata) and torch.equal(w_gpu.amax.cpu(), w_cpu.amax)
    assert gpu.model.rotary_emb.inv_freq.device.type == "cuda"
    assert torch.equal(gpu.model.rotary_emb.inv_freq.cpu(), cpu.model.rotary_emb.inv_freq)
    with torch.no_grad():
        a = cpu(tokens()).logits.float()
        b = gpu(tokens().cuda()).logits.float().cpu()
    assert ((a - b).norm() / a.norm()).item() < 1e-2


def _configs():
    from test_compile_inference import configs

    return configs()


@pytest.mark.parametrize("name", list(_configs()))
def test_save_pretrained_round_trips_every_config_bitwise(base_dir, tmp_path, name):
    """Quantized on load through TorchAoConfig, written by qtensor.save_pretrained, read back by
    qtensor.from_pretrained: every weight of the same class with equal bytes and metadata, and
    equal logits."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    model = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.bfloat16,
        quantization_config=TorchAoConfig(quant_type=_configs()[name]))
    qtensor.save_pretrained(model, tmp_path / "q")
    again = qtensor.from_pretrained(tmp_path / "q")
    quantized = 0
    for (key, a), (key2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert key == key2 and type(a) is type(b), key
        if isinstance(a, qtensor.QuantizedTensor):
            quantized += 1
            assert a.fields().keys() == b.fields().keys()
            for f, va in a.fields().items():
                vb = b.fields()[f]
                if isinstance(va, torch.Tensor):
                    assert torch.equal(va.view(torch.uint8) if va.dtype.itemsize == 1 else va,
                                       vb.view(torch.uint8) if vb.dtype.itemsize == 1 else vb), (key, f)
                else:
                    assert va == vb, (key, f)
        else:
            assert torch.equal(a, b), key
    assert quantized == 14  # every linear but lm_head (transformers keeps the output head)
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, again(tokens()).logits)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "qtensor"


def test_save_pretrained_refuses_a_plain_module(tmp_path):
    with pytest.raises(TypeError, match="takes a transformers model"):
        qtensor.save_pretrained(torch.nn.Linear(4, 4), tmp_path)


def test_qtensor_checkpoint_refuses_an_activation_override(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = qtensor.quantize_(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16),
                              qtensor.NVFP4WeightOnlyConfig())
    qtensor.save_pretrained(model, tmp_path / "q")
    with pytest.raises(ValueError, match="carry their own activation spec"):
        qtensor.from_pretrained(tmp_path / "q", activations="none")
    bad = json.loads((tmp_path / "q" / "config.json").read_text())
    bad["quantization_config"]["format"] = "other"
    (tmp_path / "q" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="format 'qtensor-safetensors'; got 'other'"):
        qtensor.from_pretrained(tmp_path / "q")
