"""transformers' own save_pretrained / from_pretrained for qtensor models
([Note: the transformers integration] in qtensor/checkpoint/hf.py).

Tiny Llamas built from a config, as in tests/test_pretrained.py; nothing is downloaded. The last
tests pin the upstream behaviours the integration works around: each asserts that behaviour
still holds, so a change upstream shows up here first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qtensor
from qtensor.checkpoint import CheckpointError
from qtensor.tensors.decode import DecodeWeight

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, TorchAoConfig  # noqa: E402

from qtensor.checkpoint import hf  # noqa: E402
from qtensor.checkpoint.pretrained import quantization_config  # noqa: E402

LAYER = "model.layers.0.self_attn.q_proj"
ROOT = Path(__file__).resolve().parents[1]


def _configs():
    from test_compile_inference import configs

    return configs()


CONFIGS = list(_configs())
ROUTES = {"torchao": lambda c: TorchAoConfig(quant_type=c), "qtensor": hf.QTensorConfig}


def llama(d, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64), **overrides})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return llama(tmp_path_factory.mktemp("base"))


def load(d, quantization_config=None):
    kwargs = {"quantization_config": quantization_config} if quantization_config else {}
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, **kwargs)


def quantized(base_dir, name, route="qtensor"):
    return load(base_dir, ROUTES[route](_configs()[name]))


def tokens():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def assert_same(a, b) -> int:
    """Same keys and classes, equal inner bytes and attributes, equal logits bit for bit;
    returns the number of quantized tensors."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    quantized = 0
    for key, ta in sa.items():
        tb = sb[key]
        assert type(ta) is type(tb), key
        if isinstance(ta, qtensor.QuantizedTensor):
            quantized += 1
            fa, fb = ta.fields(), tb.fields()
            assert fa.keys() == fb.keys(), key
            for f, va in fa.items():
                if isinstance(va, torch.Tensor):
                    vb = fb[f]
                    assert va.dtype == vb.dtype and torch.equal(_bits(va), _bits(vb)), (key, f)
                else:
                    assert va == fb[f], (key, f)
        else:
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), key
    with torch.no_grad():
        assert torch.equal(a(tokens()).logits, b(tokens()).logits)
    return quantized


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("name", CONFIGS)
def test_save_pretrained_round_trips_bitwise(base_dir, tmp_path, name, route):
    """Quantized on load (TorchAoConfig or QTensorConfig), written by transformers'
    save_pretrained, read back by transformers' from_pretrained and by qtensor.from_pretrained."""
    model = quantized(base_dir, name, route)
    model.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == quantization_config()
    assert isinstance(model.config.quantization_config, hf.QTensorConfig)  # what it wrote
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert type(again.hf_quantizer) is hf.QTensorHfQuantizer
    assert isinstance(again.config.quantization_config, hf.QTensorConfig)
    assert assert_same(model, again) == 14  # every linear but lm_head
    assert assert_same(model, qtensor.from_pretrained(tmp_path / "q")) == 14


@pytest.mark.parametrize("name", CONFIGS)
def test_both_routes_quantize_alike(base_dir, name):
    a, b = quantized(base_dir, name, "torchao"), quantized(base_dir, name, "qtensor")
    assert assert_same(a, b) == 14


def test_qtensor_save_pretrained_loads_with_transformers(base_dir, tmp_path):
    model = qtensor.quantize_(load(base_dir), qtensor.NVFP4DynamicActivationNVFP4WeightConfig())
    qtensor.save_pretrained(model, tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert type(again.hf_quantizer) is hf.QTensorHfQuantizer
    assert assert_same(model, again) == 15  # quantize_ takes lm_head too
    w = again.get_submodule(LAYER).weight
    assert isinstance(w, torch.nn.Parameter) and not w.requires_grad


def test_sharded_save_round_trips(tmp_path):
    """Small shards split quantized tensors' inner tensors over files; each shard carries the
    whole header. A tied output head is stored once and tied again on load."""
    base = llama(tmp_path / "base", tie_word_embeddings=True)
    model = load(base, hf.QTensorConfig(qtensor.NVFP4WeightOnlyConfig()))
    model.save_pretrained(tmp_path / "q", max_shard_size="20KB")
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and "lm_head.weight" not in index["weight_map"]
    files_of: dict[str, set] = {}  # quantized key -> the shards holding its inner tensors
    for name, shard in index["weight_map"].items():
        if "::" in name:
            files_of.setdefault(name.partition("::")[0], set()).add(shard)
    assert len(files_of) == 14 and any(len(f) > 1 for f in files_of.values())
    for shard in shards:
        with safe_open(tmp_path / "q" / shard, "pt") as f:
            assert json.loads(f.metadata()["qtensor"])["tensors"].keys() == files_of.keys()
    for again in (AutoModelForCausalLM.from_pretrained(tmp_path / "q"),
                  qtensor.from_pretrained(tmp_path / "q")):
        assert assert_same(model, again) == 14
        assert again.lm_head.weight is again.model.embed_tokens.weight


def test_safe_serialization_false_still_writes_safetensors(base_dir, tmp_path):
    """transformers 5 always writes safetensors (the flag is ignored), so the checkpoint is
    qtensor's; a qtensor checkpoint in any other file format is refused, naming the remedy."""
    model = quantized(base_dir, "nvfp4_weight_only")
    model.save_pretrained(tmp_path / "q", safe_serialization=False)
    assert sorted(p.name for p in (tmp_path / "q").glob("*.bin")) == []
    assert assert_same(model, AutoModelForCausalLM.from_pretrained(tmp_path / "q")) == 14
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "q" / "config.json").read_text())
    torch.save(qtensor.load_file(tmp_path / "q" / "model.safetensors"), d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"stored in safetensors files; got "
                                              r"\['pytorch_model.bin'\].*save_pretrained"):
        AutoModelForCausalLM.from_pretrained(d)


# ---- refusals -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_dir(base_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    quantized(base_dir, "nvfp4_weight_only").save_pretrained(d)
    return d


def _rewrite(src, dst, change):
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    sd = safetensors_torch.load_file(path)
    change(sd)
    safetensors_torch.save_file(sd, path, metadata=metadata)
    return dst


MALFORMED = {
    "missing inner tensor": (lambda sd: sd.pop(f"{LAYER}.weight::amax"),
                             rf"'{LAYER}.weight::amax': missing from the file"),
    "wrong dtype": (lambda sd: sd.update({f"{LAYER}.weight::scale":
                                          sd[f"{LAYER}.weight::scale"].view(torch.uint8)}),
                    rf"'{LAYER}.weight::scale': the file holds U8 \[64, 4\], the metadata "
                    r"implies torch.float8_e4m3fn"),
    "wrong shape": (lambda sd: sd.update({f"{LAYER}.weight::qdata":
                                          sd[f"{LAYER}.weight::qdata"][:32].contiguous()}),
                    rf"'{LAYER}.weight::qdata': the file holds U8 \[32, 32\], the metadata "
                    r"implies torch.uint8 \[64, 32\]"),
    "stray inner tensor": (lambda sd: sd.update({f"{LAYER}.bias::qdata": torch.zeros(2)}),
                           rf"'{LAYER}.bias::qdata': an inner tensor that no metadata entry names"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_refused_naming_the_tensor(saved_dir, tmp_path, case):
    change, match = MALFORMED[case]
    d = _rewrite(saved_dir, tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=match):
        AutoModelForCausalLM.from_pretrained(d)
    with pytest.raises(CheckpointError, match=match):
        qtensor.from_pretrained(d)


def test_rebuild_checks_each_inner_tensor_again(saved_dir):
    """QTensorDeserialize decodes through the schema, whatever reached it."""
    model = AutoModelForCausalLM.from_pretrained(saved_dir)
    op, key = hf.QTensorDeserialize(model.hf_quantizer), f"{LAYER}.weight"
    w = model.get_submodule(LAYER).weight
    good = {"::qdata": [w.qdata], "::scale": [w.scale], "::amax": [w.amax]}
    rebuilt = op.convert(good, full_layer_name=key)[key]
    assert type(rebuilt) is qtensor.NVFP4Tensor and not rebuilt.requires_grad
    assert torch.equal(rebuilt.qdata, w.qdata) and rebuilt.fields().keys() == w.fields().keys()
    with pytest.raises(CheckpointError, match=rf"'{key}::amax': missing from the checkpoint"):
        op.convert({k: v for k, v in good.items() if k != "::amax"}, full_layer_name=key)
    with pytest.raises(CheckpointError, match=rf"'{key}::scale': the checkpoint holds torch.uint8"):
        op.convert({**good, "::scale": [w.scale.view(torch.uint8)]}, full_layer_name=key)


def test_checkpoint_shape_must_match_the_model(saved_dir, tmp_path):
    d = shutil.copytree(saved_dir, tmp_path / "wide")
    config = json.loads((d / "config.json").read_text())
    config["hidden_size"] = 128
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"'{LAYER}.weight': shape \[64, 64\] in the "
                                              r"checkpoint, \[64, 128\] in LlamaForCausalLM"):
        AutoModelForCausalLM.from_pretrained(d)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "qtensor", "format": "other"}, "format 'qtensor-safetensors'; got 'other'"),
    ({"quant_method": "qtensor", "format": "qtensor-safetensors", "bits": 4},
     r"takes the keys \['format', 'quant_method', 'version'\]; got \['bits', "),
])
def test_config_json_is_checked(saved_dir, tmp_path, qc, match):
    d = shutil.copytree(saved_dir, tmp_path / "cfg")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        AutoModelForCausalLM.from_pretrained(d)


def test_qtensor_config_options_are_checked(base_dir, tmp_path):
    from torchao.quantization import Int8WeightOnlyConfig

    with pytest.raises(TypeError, match="takes a qtensor inference config .* got Int8WeightOnly"):
        hf.QTensorConfig(Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"not quantized and QTensorConfig\(\) has no quant_type"):
        load(base_dir, hf.QTensorConfig())
    odd = llama(tmp_path / "odd", intermediate_size=136)  # down_proj: in_features 136 = 8 mod 16
    with pytest.raises(ValueError, match="NVFP4 needs in_features divisible by 16; got 136 at "
                                         "layer 'model.layers.0.mlp.down_proj'.*modules_to_not"):
        load(odd, hf.QTensorConfig(qtensor.NVFP4WeightOnlyConfig()))
    model = load(odd, hf.QTensorConfig(qtensor.NVFP4WeightOnlyConfig(),
                                       modules_to_not_convert=["down_proj", "lm_head"]))
    assert type(model.model.layers[1].mlp.down_proj.weight) is torch.nn.Parameter
    assert type(model.model.layers[1].mlp.up_proj.weight) is qtensor.NVFP4Tensor


def test_torchao_checkpoints_save_as_torchao_does(base_dir, tmp_path):
    """A torchao config keeps torchao's layout; a model mixing torchao's and qtensor's tensors
    is refused rather than half written."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = load(base_dir, TorchAoConfig(quant_type=Int8WeightOnlyConfig()))
    model.save_pretrained(tmp_path / "int8")
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, again(tokens()).logits)
    mixed = quantized(base_dir, "nvfp4_weight_only", "torchao")
    quantize_(mixed.lm_head, Int8WeightOnlyConfig())
    with pytest.raises(CheckpointError, match="'lm_head.weight': Int8Tensor is not a qtensor"):
        mixed.save_pretrained(tmp_path / "mixed")
    assert type(mixed.config.quantization_config) is TorchAoConfig


# ---- registration ---------------------------------------------------------------------------------

_CHECK = """
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1])
from qtensor.checkpoint import hf
assert type(m.hf_quantizer) is hf.QTensorHfQuantizer
assert type(m.model.layers[0].mlp.up_proj.weight) is qtensor.NVFP4Tensor
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
assert AUTO_QUANTIZATION_CONFIG_MAPPING["qtensor"] is hf.QTensorConfig is qtensor.QTensorConfig
assert AUTO_QUANTIZER_MAPPING["qtensor"] is hf.QTensorHfQuantizer
assert AUTO_QUANTIZER_MAPPING["torchao"] is hf.TorchAoWithQTensorHfQuantizer
print("ok")
"""

# transformers' registry (transformers.quantizers.auto) is imported by transformers.quantizers'
# own __init__, whichever transformers module asks for it first.
ORDERS = {
    "qtensor first": "import sys, qtensor\n"
                     "assert 'transformers' not in sys.modules\n"
                     "assert 'qtensor.checkpoint.hf' not in sys.modules\n",
    "transformers first": "import sys\n"
                          "import transformers.quantizers.auto\n"
                          "from transformers import AutoModelForCausalLM\n"
                          "assert 'qtensor' not in sys.modules\n"
                          "import qtensor\n",
}


def test_registration_works_in_any_import_order(saved_dir):
    """Each order in a fresh interpreter (both run side by side, to keep the test short)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    runs = {order: subprocess.Popen([sys.executable, "-c", code + _CHECK, str(saved_dir)], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            for order, code in ORDERS.items()}
    for order, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0 and stdout.split() == ["ok"], (order, stderr[-3000:])
        assert "could not register" not in stderr, (order, stderr[-3000:])


# ---- the upstream behaviours worked around --------------------------------------------------------


def test_upstream_torchao_safetensors_cannot_flatten_qtensor_tensors():
    """transformers' TorchAoHfQuantizer saves through torchao's flatten_tensor_state_dict, whose
    allowlist is keyed by bare class name: qtensor's MXFP8Tensor is refused and qtensor's
    NVFP4Tensor is taken for torchao's own (and fails). Hence TorchAoWithQTensorHfQuantizer."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES

    assert "MXFP8Tensor" not in ALLOWED_TENSORS_SUBCLASSES
    assert "NVFP4Tensor" in ALLOWED_TENSORS_SUBCLASSES  # torchao's class of that name
    def state_dict(config):
        layer = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(torch.bfloat16)
        return qtensor.quantize_(layer, config).state_dict()

    with pytest.raises(ValueError, match="Unsupported tensor type.*qtensor.tensors.mxfp8.MXFP8"):
        flatten_tensor_state_dict(state_dict(qtensor.MXFP8WeightOnlyConfig()))
    with pytest.raises(TypeError, match="can only concatenate list"):
        flatten_tensor_state_dict(state_dict(qtensor.NVFP4WeightOnlyConfig()))


def test_upstream_torchao_config_does_not_load_qtensor_configs():
    """A saved TorchAoConfig of a qtensor config does not load back: torchao's config_from_dict
    takes classes from torchao's modules only. Hence the checkpoint names quant_method qtensor."""
    saved = TorchAoConfig(quant_type=qtensor.NVFP4WeightOnlyConfig()).to_dict()
    with pytest.raises(ValueError, match="Failed to find class NVFP4Spec in any of the allowed"):
        TorchAoConfig.from_dict(saved)


def test_upstream_torchao_loader_does_not_route_qtensor_names():
    """transformers' torchao loader routes torchao's inner names (`_weight_qdata`, ...), not
    qtensor's `KEY::NAME` (`::amax` has no torchao counterpart). Hence QTensorHfQuantizer."""
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    quantizer = TorchAoHfQuantizer(TorchAoConfig(quant_type=qtensor.NVFP4WeightOnlyConfig()),
                                   pre_quantized=True)
    converters = quantizer.get_weight_conversions()
    assert converters  # it does route torchao's names
    for name in ("qdata", "scale", "amax"):
        key = f"{LAYER}.weight::{name}"
        assert all(c.compiled_sources.search(key) is None for c in converters), key


def test_upstream_register_quantizer_refuses_a_taken_name():
    """register_quantizer refuses a name already registered, so "torchao" is replaced in
    AUTO_QUANTIZER_MAPPING itself; that entry is what AutoHfQuantizer looks up."""
    from transformers.quantizers import auto

    with pytest.raises(ValueError, match="Quantizer 'torchao' already registered"):
        auto.register_quantizer("torchao")(hf.TorchAoWithQTensorHfQuantizer)
    quantizer = auto.AutoHfQuantizer.from_config(
        TorchAoConfig(quant_type=qtensor.NVFP4WeightOnlyConfig()), pre_quantized=False)
    assert type(quantizer) is hf.TorchAoWithQTensorHfQuantizer


def test_upstream_keeps_matched_converters_for_saving(saved_dir, tmp_path, monkeypatch):
    """transformers keeps the converters that matched on load (model._weight_conversions) and
    reverses them on save; qtensor's rebuild has no reverse (saving flattens the state_dict
    itself), so the quantizer drops its converter after loading."""
    model = AutoModelForCausalLM.from_pretrained(saved_dir)
    assert not any(hf._is_qtensor_converter(c) for c in model._weight_conversions)
    model.save_pretrained(tmp_path / "again")
    monkeypatch.setattr(hf.QTensorHfQuantizer, "_process_model_after_weight_loading",
                        lambda self, model, **kwargs: model)
    kept = AutoModelForCausalLM.from_pretrained(saved_dir)
    assert any(hf._is_qtensor_converter(c) for c in kept._weight_conversions)
    with pytest.raises(NotImplementedError):
        kept.save_pretrained(tmp_path / "fails")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpoint_loads_onto_cuda_through_transformers(saved_dir, base_dir):
    """device_map="cuda": the inner tensors are read onto the GPU and rebuilt there with the
    stored bytes; quantizing on load on the GPU gives the CPU's bytes; the logits agree with the
    CPU model up to fp32 summation order."""
    cpu = AutoModelForCausalLM.from_pretrained(saved_dir)
    gpu = AutoModelForCausalLM.from_pretrained(saved_dir, device_map="cuda")
    w_cpu, w_gpu = cpu.get_submodule(LAYER).weight, gpu.get_submodule(LAYER).weight
    assert type(w_gpu) is qtensor.NVFP4Tensor and w_gpu.qdata.device.type == "cuda"
    assert torch.equal(w_gpu.qdata.cpu(), w_cpu.qdata)
    assert torch.equal(w_gpu.amax.cpu(), w_cpu.amax)
    fresh = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.bfloat16, device_map="cuda",
        quantization_config=hf.QTensorConfig(qtensor.NVFP4WeightOnlyConfig()))
    w_fresh = fresh.get_submodule(LAYER).weight  # the layout `auto` may pack it for the GPU
    w_fresh = w_fresh.canonical() if isinstance(w_fresh, DecodeWeight) else w_fresh
    assert type(w_fresh) is qtensor.NVFP4Tensor
    assert torch.equal(w_fresh.qdata.cpu(), w_cpu.qdata)
    with torch.no_grad():
        a = cpu(tokens()).logits.float()
        b = gpu(tokens().cuda()).logits.float().cpu()
        c = fresh(tokens().cuda()).logits.float().cpu()
    assert ((a - b).norm() / a.norm()).item() < 1e-2
    assert ((a - c).norm() / a.norm()).item() < 1e-2
