"""gpt-oss MXFP4 checkpoints through `qtensor.from_pretrained` (CPU, a tiny GptOssConfig built
here, nothing downloaded).

The checkpoint is written by a path independent of qtensor's reader: transformers saves the bf16
model, then the expert weights are replaced by `*_blocks` / `*_scales` bytes, drawn at random
for layer 0 and made by `qtensor.qat.export_weight` from the real weights for layer 1. The
oracle is transformers' own reader, `Mxfp4Config(dequantize=True)` (on the CPU it dequantizes
with its own E2M1 table and ldexp).

Tolerances. In float32 both models multiply the same exact fp32 weight values (an E2M1 value
times a power of two) in fp32; only the summation order of the matmuls may differ, so logits
agree to rtol 1e-4 / atol 1e-5 (of logits of order 1). In bfloat16 transformers multiplies bf16
operands while qtensor's reference rounds its fp32 product once: a bf16 rounding can flip by
one ulp (2**-8 relative) and propagate through two layers, so the bound is 5% of the largest
logit; the two agree exactly on this machine, which the test does not rely on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import qtensor
from qtensor import MXFP4Tensor
from qtensor.checkpoint import CheckpointError
from qtensor.checkpoint import gpt_oss
from qtensor.qat import decode_weight, export_weight

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM  # noqa: E402

EXCLUDED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def tiny_config(**changes) -> GptOssConfig:
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"])
    return GptOssConfig(**{**kw, **changes})


def expert_bytes(key: str, param: torch.Tensor, g: torch.Generator):
    """(blocks [E, N, K/32, 16], scales [E, N, K/32]) of an expert parameter [E, K, N]."""
    stored = param.transpose(-1, -2)  # [E, N, K]: blocks run along K, the reduction dim
    e, n, k = stored.shape
    if ".layers.0." in key:  # bytes drawn directly: every code, scales around 2**-8
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(116, 122, (e, n, k // 32), dtype=torch.uint8, generator=g)
        return blocks, scales
    pairs = [export_weight(stored[i].contiguous(), key) for i in range(e)]
    return torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])


def write_checkpoint(d: Path, tensors: dict, config: dict, shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[i::shards]}
            save_file(part, d / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(directory, the tensors written, the config written) of a tiny gpt-oss MXFP4 checkpoint."""
    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    GptOssForCausalLM(tiny_config()).to(torch.bfloat16).save_pretrained(root / "base")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for key, t in load_file(root / "base" / "model.safetensors").items():
        if key.endswith(EXPERTS):
            tensors[key + "_blocks"], tensors[key + "_scales"] = expert_bytes(key, t, g)
        else:
            tensors[key] = t
    config = json.loads((root / "base" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": EXCLUDED}
    d = write_checkpoint(root / "mxfp4", tensors, config)
    shutil.copy(root / "base" / "generation_config.json", d)
    return d, tensors, config


TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def test_loads_the_file_bytes_as_mxfp4_expert_weights(ckpt):
    d, tensors, _ = ckpt
    model = qtensor.from_pretrained(d, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    for layer in range(2):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            w = model.get_parameter(key)
            blocks, scales = tensors[key + "_blocks"], tensors[key + "_scales"]
            assert type(w) is MXFP4Tensor and not w.requires_grad
            assert w.axis == "columnwise" and w.dtype == torch.bfloat16
            # [E, K, N]: the transpose of the stored [E, N, K], the bytes untouched
            assert w.shape == (4, scales.shape[-1] * 32, scales.shape[1])
            assert torch.equal(w.qdata.reshape(blocks.shape), blocks)
            assert torch.equal(w.scale, scales)
    assert experts.gate_up_proj_bias.dtype == torch.bfloat16
    assert type(model.model.layers[0].self_attn.q_proj.weight) is torch.nn.Parameter
    out = model.generate(TOKENS[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 16)


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-4, 1e-5),
                                               (torch.bfloat16, 0.0, None)])
def test_logits_equal_transformers_own_mxfp4_reader(ckpt, dtype, rtol, atol):
    from transformers import Mxfp4Config

    d = ckpt[0]
    ours = qtensor.from_pretrained(d, dtype=dtype)
    theirs = AutoModelForCausalLM.from_pretrained(
        d, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype)
    for layer in range(2):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            assert torch.equal(ours.get_parameter(key).dequantize(), theirs.get_parameter(key))
    with torch.no_grad():
        a, b = ours(TOKENS).logits, theirs(TOKENS).logits
    assert a.dtype == b.dtype == dtype
    atol = 0.05 * b.abs().max().item() if atol is None else atol
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_sharded_checkpoint_loads_the_same(ckpt, tmp_path):
    d, tensors, config = ckpt
    sharded = write_checkpoint(tmp_path / "sharded", tensors, config, shards=3)
    a, b = qtensor.from_pretrained(d), qtensor.from_pretrained(sharded)
    key = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(a.get_parameter(key).qdata, b.get_parameter(key).qdata)
    with torch.no_grad():
        assert torch.equal(a(TOKENS).logits, b(TOKENS).logits)


L0 = "model.layers.0.mlp.experts.gate_up_proj"
L1D = "model.layers.1.mlp.experts.down_proj"


def _drop(key):
    return lambda t, c: {k: v for k, v in t.items() if k != key}


def _replace(key, fn):
    return lambda t, c: {**t, key: fn(t[key])}


def _set_scale_255(t, c):
    s = t[L0 + "_scales"].clone()
    s[1, 3, 0] = 255
    return {**t, L0 + "_scales": s}


def _store_high_precision(t, c):
    out = {k: v for k, v in t.items() if not k.startswith(L1D + "_")}
    return {**out, L1D: torch.zeros(4, 64, 64, dtype=torch.bfloat16)}


def _excluded_but_quantized(t, c):
    key = "model.layers.0.self_attn.q_proj.weight"
    out = {k: v for k, v in t.items() if k != key}
    return {**out, key + "_blocks": torch.zeros(64, 2, 16, dtype=torch.uint8),
            key + "_scales": torch.full((64, 2), 127, dtype=torch.uint8)}


MALFORMED = {
    "blocks without scales": (_drop(L0 + "_scales"), "has no '.*gate_up_proj_scales'"),
    "scales without blocks": (_drop(L0 + "_blocks"), "has no '.*gate_up_proj_blocks'"),
    "blocks of another dtype": (_replace(L0 + "_blocks", lambda v: v.view(torch.int8)),
                                "blocks and scales are uint8 \\(U8\\); got I8"),
    "scales of another dtype": (_replace(L0 + "_scales", lambda v: v.float()),
                                "blocks and scales are uint8 \\(U8\\); got F32"),
    "scales disagree with blocks": (_replace(L0 + "_scales", lambda v: v[..., :1].contiguous()),
                                    "one UE8M0 code per block"),
    "blocks not 16 bytes a block": (_replace(L0 + "_blocks", lambda v: v.reshape(4, 128, 4, 8)),
                                    "16 bytes per 32-element block"),
    "shape not the model's": (lambda t, c: {**t, L0 + "_blocks": t[L0 + "_blocks"][:3],
                                            L0 + "_scales": t[L0 + "_scales"][:3]},
                              "the parameter '.*gate_up_proj' would be \\[3, 64, 128\\]"),
    "config quantizes what the file lacks": (_store_high_precision,
                                             "config quantizes this parameter, but the "
                                             "checkpoint has no"),
    "quantized but excluded": (_excluded_but_quantized,
                               "config does not quantize '.*q_proj.weight' "
                               "\\(modules_to_not_convert"),
    "scale code 255": (_set_scale_255, "1 block scale\\(s\\) hold code 255"),
    "unknown quant_method": (lambda t, c: c.update(quantization_config={"quant_method": "mxfp6"})
                             or t, "quant_method is 'mxfp6'.*gpt-oss 'mxfp4'"),
    "bad modules_to_not_convert": (
        lambda t, c: c.update(quantization_config={"quant_method": "mxfp4",
                                                   "modules_to_not_convert": "lm_head"}) or t,
        "modules_to_not_convert must be a list"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoints_are_refused_before_the_model_is_built(ckpt, tmp_path, case,
                                                                      monkeypatch):
    d, tensors, config = ckpt
    mutate, match = MALFORMED[case]
    config = json.loads(json.dumps(config))
    bad = write_checkpoint(tmp_path / "bad", mutate(dict(tensors), config), config)

    def placed(*args, **kwargs):
        raise AssertionError("a tensor was placed into the model before the checks finished")

    monkeypatch.setattr(gpt_oss, "place", placed)
    with pytest.raises(CheckpointError, match=match):
        qtensor.from_pretrained(bad)


def test_activations_do_not_apply(ckpt):
    with pytest.raises(ValueError, match="quantizes weights only"):
        qtensor.from_pretrained(ckpt[0], activations="dynamic")


def test_converts_reads_modules_to_not_convert_as_transformers_does():
    assert not gpt_oss.converts("model.layers.11.self_attn.q_proj", EXCLUDED)
    assert not gpt_oss.converts("lm_head", EXCLUDED)
    assert gpt_oss.converts("model.layers.0.mlp.experts", EXCLUDED)
    assert gpt_oss.converts("model.layers.1.mlp.gate", ["model.layers.1.mlp.gate_proj"])
    assert not gpt_oss.converts("model.layers.1.mlp.gate_proj", ["mlp.gate_proj"])


def test_export_mxfp4_linear_weights_load_rowwise(tmp_path):
    """qtensor.checkpoint.export_mxfp4 of a model's nn.Linear weights (gpt-oss layout, no
    transpose: F.linear reduces over the weight's last dim) loads as rowwise MXFP4Tensors whose
    logits equal the high-precision model holding the decoded weights (the same exact values
    in the same fp32 products)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qtensor.checkpoint import export_mxfp4

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    export_mxfp4(model, tmp_path, select=lambda k, t: ".mlp." in k and k.endswith(".weight"),
                 config=config.to_dict())
    served = qtensor.from_pretrained(tmp_path, dtype=torch.float32)
    w = served.model.layers[0].mlp.up_proj.weight
    assert type(w) is MXFP4Tensor and w.axis == "rowwise" and w.shape == (128, 64)
    stored = load_file(tmp_path / "model.safetensors")
    for name, m in model.named_modules():
        if ".mlp." in name and isinstance(m, torch.nn.Linear):
            m.weight.data = decode_weight(stored[f"{name}.weight_blocks"],
                                          stored[f"{name}.weight_scales"])
    with torch.no_grad():
        torch.testing.assert_close(served(TOKENS).logits, model(TOKENS).logits, rtol=1e-4,
                                   atol=1e-5)


def test_export_mxfp4_of_gpt_oss_experts_loads_back(tmp_path):
    """export_mxfp4 of a gpt-oss model's expert parameters [E, K, N] writes them as gpt-oss
    stores them ([E, N, K], blocked along K, the reduction dim) and qtensor.from_pretrained reads
    them back to exactly the values MXFP4 QAT projects them to (mxfp4.fake_quantize_values
    along K), whatever the shape: the tiny config's down_proj is square (H = I)."""
    from qtensor.checkpoint import export_mxfp4
    from qtensor.formats import mxfp4

    config = tiny_config()
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).float().eval()
    export_mxfp4(model, tmp_path, select=lambda k, t: k.endswith(EXPERTS),
                 config=config.to_dict())
    served = qtensor.from_pretrained(tmp_path, dtype=torch.float32)
    for layer, src in zip(served.model.layers, model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            got, w = getattr(layer.mlp.experts, name), getattr(src.mlp.experts, name).detach()
            assert type(got) is MXFP4Tensor and got.shape == w.shape
            want = mxfp4.fake_quantize_values(w.transpose(-1, -2)).transpose(-1, -2)
            assert torch.equal(got.dequantize(torch.float32), want), name
