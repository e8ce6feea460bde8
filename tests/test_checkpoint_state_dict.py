"""state_dict round trips of quantized models: torch.save/torch.load(weights_only=True), loading
into a fresh quantize_'d model and into a meta-device model, and clear, all-or-nothing errors."""

import io
import os

import pytest
import torch
from conftest import leaves
from torch import nn

import qtensor
from qtensor.checkpoint import CheckpointError, check_state_dict, load, load_state_dict
from qtensor.formats import MXFP8Spec, NVFP4Spec
from qtensor.tensors import HybridTensor

# Every tensor class and option a checkpoint must carry. in=64, hidden=64, out=32 keep every
# block rule (16, 32, 16x16) satisfied.
CONFIGS = {
    "nvfp4": lambda: qtensor.NVFP4WeightOnlyConfig(),
    "nvfp4_dyn_rowscaled": lambda: qtensor.NVFP4DynamicActivationNVFP4WeightConfig(
        weight=NVFP4Spec(row_scaled=True), activation=NVFP4Spec(row_scaled=True)),
    "nvfp4_4o6_b256": lambda: qtensor.NVFP4DynamicActivationNVFP4WeightConfig(
        weight=NVFP4Spec(fourover6="mae", e4m3_bound=256),
        activation=NVFP4Spec(fourover6="mse", e4m3_bound=256)),
    "nvfp4_2d": lambda: qtensor.NVFP4WeightOnlyConfig(weight=NVFP4Spec(block_2d=True)),
    "mxfp8": lambda: qtensor.MXFP8WeightOnlyConfig(),
    "mxfp8_dyn_floor": lambda: qtensor.MXFP8DynamicActivationMXFP8WeightConfig(
        weight=MXFP8Spec("floor"), activation=MXFP8Spec("floor")),
    "hybrid": "hybrid",
}


def make_model(name: str, seed: int, device=None) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    if name == "hybrid":  # NVFP4 fprop side, MXFP8 dgrad side from the decoded rowwise bytes
        for m in (model[0], model[2]):
            w = HybridTensor.from_hp(m.weight.detach(), rowwise=NVFP4Spec(block_2d=True),
                                     columnwise=MXFP8Spec(),
                                     columnwise_source="rowwise_dequantized")
            m.weight = nn.Parameter(w, requires_grad=False)
    else:
        qtensor.quantize_(model, CONFIGS[name]())
    return model


def inputs():
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


def weight_bytes(model):
    sd = model.state_dict()
    return {k: torch.cat([x.detach().reshape(-1).view(torch.uint8) for x in leaves(v)])
            for k, v in sd.items()}


def saved(model) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_into_fresh_quantized_model(name):
    src, dst = make_model(name, 0), make_model(name, 1)
    x = inputs()
    with torch.no_grad():
        want = src(x)
        assert not torch.equal(dst(x), want)  # the load below has something to do
    sd = load(saved(src))
    assert isinstance(sd["0.weight"], type(src[0].weight))
    load_state_dict(dst, sd)
    with torch.no_grad():
        assert torch.equal(dst(x), want)
    assert repr(dst[0].weight) == repr(src[0].weight)


@pytest.mark.parametrize("name", ["nvfp4_4o6_b256", "mxfp8", "hybrid", "nvfp4_dyn_rowscaled"])
def test_round_trip_into_meta_model(name):
    src = make_model(name, 0)
    with torch.device("meta"):
        dst = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    load_state_dict(dst, load(saved(src)), assign=True)
    assert not dst[0].weight.requires_grad and dst[0].weight.device.type == "cpu"
    with torch.no_grad():
        assert torch.equal(dst(inputs()), src(inputs()))


MISMATCH = [  # (checkpoint config, model config, field the error must name)
    ("nvfp4", "mxfp8", "MXFP8Tensor"),
    ("nvfp4_4o6_b256", "nvfp4", "e4m3_bound"),
    ("nvfp4_2d", "nvfp4", "block_2d"),
    ("nvfp4_dyn_rowscaled", "nvfp4", "row_scaled"),
]


@pytest.mark.parametrize("ckpt,target,field", MISMATCH)
def test_metadata_mismatch_names_key_and_field(ckpt, target, field):
    dst = make_model(target, 1)
    before = weight_bytes(dst)
    sd = load(saved(make_model(ckpt, 0)))
    with pytest.raises(CheckpointError, match=rf"(?s)'0\.weight'.*{field}"):
        load_state_dict(dst, sd)
    assert all(torch.equal(before[k], v) for k, v in weight_bytes(dst).items())
    # Plain nn.Module.load_state_dict also names the key and the field (via copy_).
    if type(sd["0.weight"]) is type(dst[0].weight):
        with pytest.raises(RuntimeError, match=rf"(?s)0\.weight.*{field}"):
            dst.load_state_dict(sd)


def test_meta_model_already_quantized_still_checks_format():
    with torch.device("meta"):
        dst = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    qtensor.quantize_(dst, qtensor.NVFP4WeightOnlyConfig())
    with pytest.raises(CheckpointError, match="e4m3_bound"):
        load_state_dict(dst, load(saved(make_model("nvfp4_4o6_b256", 0))), assign=True)


def test_backend_attributes_are_informational():
    src, dst = make_model("nvfp4", 0), make_model("nvfp4", 1)
    sd = src.state_dict()
    sd["0.weight"] = sd["0.weight"].replace(gemm_backend="triton", quant_backend="cuda")
    load_state_dict(dst, sd)
    assert dst[0].weight.gemm_backend == "emulated"  # the model keeps its own backends
    assert torch.equal(dst[0].weight.qdata, src[0].weight.qdata)


def test_no_half_loaded_state():
    src, dst = make_model("nvfp4", 0), make_model("nvfp4", 1)
    before = weight_bytes(dst)
    sd = dict(src.state_dict())
    sd["2.bias"] = torch.zeros(7, dtype=torch.bfloat16)  # wrong shape, after valid keys
    del sd["0.bias"]
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as e:
        load_state_dict(dst, sd)
    msg = str(e.value)
    assert "'2.bias': shape (7,)" in msg and "'0.bias': missing" in msg
    assert "'extra.weight': not in the model" in msg
    assert all(torch.equal(before[k], v) for k, v in weight_bytes(dst).items())


def test_high_precision_into_quantized_and_back():
    hp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    with pytest.raises(CheckpointError, match="never quantized implicitly"):
        check_state_dict(make_model("nvfp4", 1), hp.state_dict())
    with pytest.raises(CheckpointError, match="pass assign=True"):
        check_state_dict(hp, make_model("nvfp4", 0).state_dict())


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_disallowed_global_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"0.weight": _Evil()}, path)  # what a hostile checkpoint looks like
    with pytest.raises(CheckpointError, match="not a weights-only checkpoint: .*GLOBAL posix.system"):
        load(path)


def test_assign_load_into_a_meta_hf_model_names_unsaved_buffers():
    """A transformers Llama built on meta keeps its rotary inv_freq (a non-persistent buffer,
    never saved) on meta after an assign-load: refused before loading, naming the buffers; the
    documented remedy (rebuild the rotary embedding on the CPU first) then loads bit for bit."""
    transformers = pytest.importorskip("transformers")
    import qtensor
    from qtensor.checkpoint import CheckpointError, load_state_dict

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    pick = lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head"  # noqa: E731
    torch.manual_seed(0)
    src = qtensor.quantize_(transformers.LlamaForCausalLM(cfg), qtensor.NVFP4WeightOnlyConfig(),
                            filter_fn=pick)
    with torch.device("meta"):
        dst = transformers.LlamaForCausalLM(cfg)
    qtensor.quantize_(dst, qtensor.NVFP4WeightOnlyConfig(), filter_fn=pick)
    with pytest.raises(CheckpointError, match=r"'model.rotary_emb.inv_freq'.*on the meta device "
                                              r"and not in the checkpoint.*rotary_emb"):
        load_state_dict(dst, src.state_dict(), assign=True)
    dst.model.rotary_emb = type(dst.model.rotary_emb)(dst.config)
    load_state_dict(dst, src.state_dict(), assign=True)
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(dst(ids).logits, src(ids).logits)
