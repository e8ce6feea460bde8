"""Quantized transformers checkpoints: `from_pretrained` builds the transformers model of a
checkpoint directory whose quantized weights are qtensor tensors holding the file's bytes
(nothing is dequantized and requantized); `save_pretrained` writes one.

Four layouts are read: qtensor's own (what `save_pretrained` writes: config.json with
`quantization_config.quant_method` "qtensor", and model.safetensors written by
`qtensor.save_file`, whose header describes every quantized tensor, [Note: checkpoint
schema] in qtensor/checkpoint/schema.py; transformers' own `model.save_pretrained` writes the
same layout, possibly sharded, through qtensor/checkpoint/hf.py), the NVFP4 layouts of two
other writers, below, and gpt-oss-style MXFP4 (config.json `quant_method` "mxfp4": [Note: reading
gpt-oss MXFP4 checkpoints] in qtensor/checkpoint/gpt_oss.py).

[Note: reading NVFP4 checkpoints]
Two writers' layouts, per quantized linear layer NAME (N output features, K inputs):
- compressed-tensors (llm-compressor; config.json `quantization_config.quant_method` is
  "compressed-tensors", format "nvfp4-pack-quantized"):
      NAME.weight_packed        uint8 [N, K/2]           E2M1 codes, element 2j in the low nibble
      NAME.weight_scale         float8_e4m3fn [N, K/16]  block scales s_b
      NAME.weight_global_scale  float32 [1]              the encode scale S_enc = 2688 / amax
      NAME.input_global_scale   float32 [1]              (W4A4) the static activation S_enc
  decoded by the writer as value(q) * (s_b / S_enc).
- NVIDIA ModelOpt (`hf_quant_config.json` with `quantization.quant_algo` "NVFP4", or the same
  block as config.json's `quantization_config` with quant_method "modelopt"):
      NAME.weight               uint8 [N, K/2]           the same codes and packing
      NAME.weight_scale         float8_e4m3fn [N, K/16]  block scales s_b
      NAME.weight_scale_2       float32 [] or [1]        the decode scale amax / 2688
      NAME.input_scale          float32 [] or [1]        the static activation decode scale
  decoded as value(q) * (s_b * weight_scale_2).
qtensor keeps the codes and block scales as its `qdata` and `scale` and takes the per-tensor
amax A (bound B = 448, 6 B = 2688) from the global scale: A = r(2688 / S_enc), or
A = r(weight_scale_2 * 2688). Its decode is docs/formats.md's step 7,
value(q) * r(r(s_b * A) * r(1 / 2688)); the writers' own decode rounds the per-block factor
once (a division or a product), so a decoded value can differ from theirs in the last fp32 bit
(the GEMM multiplies the exact value(q) * s_b and applies A / 2688 once per output, in fp32).

Activations: both layouts' W4A4 form carries a static activation scale, which qtensor's dynamic
activation quantization does not use (it takes each call's own amax). So a checkpoint with
quantized inputs loads only when the caller says what to do with them: activations="dynamic"
quantizes each layer's input to NVFP4 on the fly (qtensor's rule, not the checkpoint's
calibrated scale), activations="none" runs the layers weight-only (bf16 activations).

Everything is checked before any weight is placed: the scheme and its arguments, every quantized
layer's tensors (dtype, shape, a finite positive global scale), that each layer the config
quantizes has them and each one found is a linear layer of the model with matching shape, and
that the remaining tensors cover the model exactly. A failure raises CheckpointError naming the
tensor and the rule, and no model is returned.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from qtensor.checkpoint import gpt_oss
from qtensor.checkpoint.model_dir import (Reader, materialize_buffers, place, plain_tensors,
                                          read_json, weight_files)
from qtensor.checkpoint.safetensors import Files, save_file
from qtensor.checkpoint.schema import CheckpointError
from qtensor.checkpoint.state_dict import load_state_dict
from qtensor.formats import NVFP4Spec
from qtensor.formats.elements import fdiv
from qtensor.tensors import NVFP4Tensor, QuantizedTensor
from qtensor.version import __version__

COMPRESSED_TENSORS, MODELOPT, QTENSOR = "compressed-tensors", "modelopt", "qtensor"
MXFP4 = gpt_oss.MXFP4_METHOD
NVFP4_FORMAT = "nvfp4-pack-quantized"
QTENSOR_FORMAT = "qtensor-safetensors"
ACTIVATIONS = ("checkpoint", "dynamic", "none")
_FP4_TIMES_E4M3 = 6.0 * 448  # 6 B: the global scale's constant for bound B = 448


class Scheme(NamedTuple):
    """What a checkpoint's config says: the writer, which linear layers it quantizes (a
    predicate on the layer name) and whether it quantizes their inputs."""

    writer: str
    quantizes: Any  # callable(name) -> bool: a linear layer the config quantizes
    inputs: bool  # W4A4: the checkpoint carries static activation scales


class Layer(NamedTuple):
    name: str
    packed: str  # tensor names in the checkpoint
    scale: str
    global_scale: str
    input_scale: str | None


# ---- the scheme ---------------------------------------------------------------------------------


def _matches(patterns, name: str, regex_prefix: str | None) -> bool:
    """Whether a layer name matches one of the patterns: "re:<regex>" (compressed-tensors) or an
    fnmatch wildcard (ModelOpt), else the exact name or a module class name ("Linear")."""
    for p in patterns or ():
        if regex_prefix and p.startswith(regex_prefix):
            if re.match(p[len(regex_prefix):], name):
                return True
        elif p == name or p == "Linear" or fnmatch.fnmatchcase(name, p):
            return True
    return False


def _check_fp4_args(where: str, args: Any, what: str) -> None:
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: {what} must be an object of quantization arguments; got "
                              f"{type(args).__name__}.")
    want["symmetric"] = True
    bad = {k: args.get(k, True if k == "symmetric" else None) for k in want}
    bad = {k: v for k, v in bad.items() if v != want[k]}
    if bad:
        raise CheckpointError(f"{where}: {what} are not NVFP4 (qtensor reads {want}); got {bad}.")


def _compressed_tensors_scheme(qc: dict) -> Scheme:
    where = "config.json quantization_config"
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: needs config_groups; got {groups!r}.")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise CheckpointError(
            f"{where}: quantization_status is {qc.get('quantization_status')!r}; qtensor reads "
            "compressed checkpoints (weights stored as weight_packed), status 'compressed'.")
    targets, inputs = [], set()
    for gname, g in groups.items():
        gfmt = g.get("format") or fmt
        if gfmt != NVFP4_FORMAT:
            raise CheckpointError(
                f"{where}: group {gname!r} has format {gfmt!r}; qtensor reads {NVFP4_FORMAT!r}. "
                "Other compressed-tensors schemes are not supported.")
        _check_fp4_args(f"{where} group {gname!r}", g.get("weights"), "weights")
        act = g.get("input_activations")
        if act is not None:
            _check_fp4_args(f"{where} group {gname!r}", act, "input_activations")
        inputs.add(act is not None)
        if g.get("output_activations") is not None:
            raise CheckpointError(f"{where}: group {gname!r} quantizes output activations, which "
                                  "qtensor does not run.")
        targets += list(g.get("targets") or [])
    if len(inputs) != 1:
        raise CheckpointError(f"{where}: groups disagree on input activations (some quantize "
                              "them, some do not); qtensor loads one rule per checkpoint.")
    ignore = list(qc.get("ignore") or [])

    def quantizes(name: str) -> bool:
        return _matches(targets, name, "re:") and not _matches(ignore, name, "re:")

    return Scheme(COMPRESSED_TENSORS, quantizes, inputs.pop())


def _modelopt_scheme(q: dict, where: str) -> Scheme:
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise CheckpointError(f"{where}: quant_algo is {algo!r}; qtensor reads ModelOpt's 'NVFP4' "
                              "(not NVFP4_AWQ, FP8 or W4A8 variants).")
    if q.get("group_size", 16) != 16:
        raise CheckpointError(f"{where}: group_size must be 16 for NVFP4; got "
                              f"{q.get('group_size')!r}.")
    exclude = list(q.get("exclude_modules") or [])

    def quantizes(name: str) -> bool:
        return not _matches(exclude, name, None)

    return Scheme(MODELOPT, quantizes, True)


def read_scheme(model_dir: str | os.PathLike) -> Scheme:
    """The checkpoint's writer and quantization rule, validated; raises CheckpointError."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d} has no config.json: not a transformers checkpoint directory.")
    qc = read_json(d / "config.json").get("quantization_config")
    if (d / "hf_quant_config.json").is_file():
        hq = read_json(d / "hf_quant_config.json")
        return _modelopt_scheme(hq.get("quantization") or {}, "hf_quant_config.json quantization")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == QTENSOR:
        if qc.get("format") != QTENSOR_FORMAT:
            raise CheckpointError(f"config.json quantization_config: a qtensor checkpoint has "
                                  f"format {QTENSOR_FORMAT!r}; got {qc.get('format')!r}.")
        return Scheme(QTENSOR, lambda name: True, False)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors_scheme(qc)
    if method == MODELOPT:
        return _modelopt_scheme(qc.get("quantization", qc), "config.json quantization_config")
    if method == MXFP4:
        excluded = gpt_oss.read_excluded(qc)
        return Scheme(MXFP4, lambda name: gpt_oss.converts(name, excluded), False)
    raise CheckpointError(
        f"{d}: no quantized checkpoint qtensor reads (quantization_config.quant_method is "
        f"{method!r}; qtensor.from_pretrained reads 'qtensor', 'compressed-tensors' with format "
        f"{NVFP4_FORMAT!r}, ModelOpt NVFP4 and gpt-oss 'mxfp4'). For an unquantized checkpoint, "
        "load it with transformers and quantize it with qtensor.quantize_ or TorchAoConfig.")


# ---- the checkpoint's tensors ----------------------------------------------------------------------


def find_layers(scheme: Scheme, names) -> dict[str, Layer]:
    """{layer name: its tensors} for every quantized layer the checkpoint holds."""
    names = set(names)
    layers = {}
    if scheme.writer == COMPRESSED_TENSORS:
        for key in names:
            if key.endswith(".weight_packed"):
                n = key[: -len(".weight_packed")]
                inp = f"{n}.input_global_scale"
                layers[n] = Layer(n, key, f"{n}.weight_scale", f"{n}.weight_global_scale",
                                  inp if inp in names else None)
    else:
        for key in names:
            if key.endswith(".weight_scale_2"):
                n = key[: -len(".weight_scale_2")]
                inp = f"{n}.input_scale"
                layers[n] = Layer(n, f"{n}.weight", f"{n}.weight_scale", key,
                                  inp if inp in names else None)
    return layers


def _check_layer(layer: Layer, reader: Reader, names: set, n: int, k: int,
                 scheme: Scheme) -> None:
    """The dtypes and shapes of one layer's tensors against the model's [N, K] weight."""
    for key in (layer.packed, layer.scale, layer.global_scale):
        if key not in names:
            raise CheckpointError(f"{key!r}: missing; an NVFP4 layer needs {layer.packed!r}, "
                                  f"{layer.scale!r} and {layer.global_scale!r}.")
    want = {layer.packed: ((n, k // 2), "U8"), layer.scale: ((n, k // 16), "F8_E4M3")}
    for key, (shape, dtype) in want.items():
        got = reader.meta(key)
        if got != (shape, dtype):
            raise CheckpointError(
                f"{key!r}: must be {dtype} {list(shape)} for the model's [{n}, {k}] weight "
                f"(packed E2M1 codes [N, K/2], E4M3 block scales [N, K/16]); got {got[1]} "
                f"{list(got[0])}.")
    for key in (layer.global_scale, layer.input_scale):
        if key is None:
            continue
        shape, dtype = reader.meta(key)
        if dtype != "F32" or shape not in ((), (1,)):
            raise CheckpointError(f"{key!r}: a global scale must be one float32 value ([] or "
                                  f"[1]); got {dtype} {list(shape)}.")
    if scheme.inputs and layer.input_scale is None:
        want_in = "input_global_scale" if scheme.writer == COMPRESSED_TENSORS else "input_scale"
        raise CheckpointError(f"{layer.name!r}: the config quantizes inputs, but the checkpoint "
                              f"has no {layer.name}.{want_in}.")


def _global_to_amax(layer: Layer, value: torch.Tensor, writer: str) -> torch.Tensor:
    g = value.reshape(()).float()
    if not bool(torch.isfinite(g)) or not bool(g > 0):
        raise CheckpointError(f"{layer.global_scale!r}: must be finite and positive; got "
                              f"{g.item()}.")
    c = torch.tensor(_FP4_TIMES_E4M3)
    return fdiv(c, g) if writer == COMPRESSED_TENSORS else g * c


# ---- building the model ---------------------------------------------------------------------------


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def from_pretrained(model_dir: str | os.PathLike, *, activations: str = "checkpoint",
                    model_class=None, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", **hf_kwargs) -> nn.Module:
    """The transformers model of a quantized checkpoint directory with each quantized weight a
    qtensor tensor of the stored bytes: NVFP4 (compressed-tensors or ModelOpt, [Note: reading
    NVFP4 checkpoints]) linear weights as NVFP4Tensor, gpt-oss MXFP4 expert (and linear)
    weights as MXFP4Tensor ([Note: reading gpt-oss MXFP4 checkpoints] in gpt_oss.py), a qtensor
    checkpoint's tensors as saved; the other tensors as stored (cast to `dtype` if given).

    activations: for a checkpoint whose config quantizes layer inputs (W4A4), "dynamic" (NVFP4
    activations quantized on the fly with their own amax) or "none" (weight-only); the default
    "checkpoint" refuses such a checkpoint, since its static activation scales are not what
    qtensor would apply. model_class: a transformers class with `from_config` (default
    AutoModelForCausalLM). hf_kwargs go to AutoConfig.from_pretrained. The model is in eval
    mode, on `device`, with every parameter frozen (requires_grad=False), as a served model.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}; got {activations!r}.")
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(model_dir)
    scheme = read_scheme(d)
    if scheme.inputs and activations == "checkpoint":
        raise CheckpointError(
            f"{d}: the checkpoint quantizes layer inputs with static activation scales (W4A4), "
            "which qtensor does not apply. Pass activations='dynamic' to quantize inputs to NVFP4 "
            "on the fly (each call's own amax), or activations='none' to run weight-only.")
    config = AutoConfig.from_pretrained(d, **hf_kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = (model_class or AutoModelForCausalLM).from_config(
            config, **({"dtype": dtype} if dtype is not None else {}))
    if scheme.writer == QTENSOR:
        if activations != "checkpoint":
            raise ValueError("a qtensor checkpoint's weights carry their own activation spec; "
                             f"activations={activations!r} does not apply to it.")
        _load_qtensor(model, d, torch.device(device))
        return model.eval()
    if scheme.writer == MXFP4:
        if activations != "checkpoint":
            raise ValueError("an MXFP4 checkpoint quantizes weights only; "
                             f"activations={activations!r} does not apply to it.")
        gpt_oss.load(model, d, scheme.quantizes, torch.device(device))
        return model.eval()
    reader = Reader(weight_files(d))
    try:
        names = set(reader.files)
        layers = find_layers(scheme, names)
        plan = _plan(model, scheme, layers, reader, names)
        _load(model, plan, layers, reader, scheme, activations, torch.device(device))
    finally:
        reader.close()
    return model.eval()


def _load_qtensor(model: nn.Module, d: Path, device: torch.device) -> None:
    """qtensor's own layout (one file, or shards named by model.safetensors.index.json, as
    transformers' save_pretrained writes them): the state_dict, every key checked, assigned
    whole. A tied weight the writer stored once (transformers drops the duplicate) is taken from
    the weight it is tied to."""
    with Files(sorted(set(weight_files(d).values()))) as files:
        state_dict = files.load(device)
    want = model.state_dict(keep_vars=True)
    for key, t in state_dict.items():
        dst = want.get(key)
        if dst is not None and not isinstance(t, QuantizedTensor) and t.is_floating_point():
            state_dict[key] = t.to(dst.dtype)
    tied = getattr(model, "all_tied_weights_keys", None)
    for target, source in (tied.items() if isinstance(tied, dict) else ()):
        if target not in state_dict and source in state_dict:
            state_dict[target] = state_dict[source]
    materialize_buffers(model, device)
    load_state_dict(model, state_dict, assign=True)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    for p in model.parameters():
        p.requires_grad_(False)


def quantization_config() -> dict:
    """config.json's `quantization_config` of a qtensor checkpoint (what `read_scheme` reads as
    the qtensor layout)."""
    return {"quant_method": QTENSOR, "format": QTENSOR_FORMAT, "version": __version__}


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write a transformers model, quantized by any qtensor config (through quantize_ or
    TorchAoConfig), as a checkpoint directory `from_pretrained` reads back bitwise: config.json
    (quant_method "qtensor"), generation_config.json when the model has one, and
    model.safetensors written by `qtensor.save_file` (one file; tied weights are stored under
    each of their names)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise TypeError(f"save_pretrained takes a transformers model (with a .config); got "
                        f"{type(model).__name__}. For any other module use qtensor.save_file("
                        "model.state_dict(), path).")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), d / "model.safetensors", metadata={"format": "pt"})
    data = json.loads(config.to_json_string(use_diff=False))
    data["quantization_config"] = quantization_config()
    data["architectures"] = [type(model).__name__]
    (d / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(d)


def _plan(model, scheme: Scheme, layers: dict[str, Layer], reader: Reader, names: set) -> dict:
    """Check everything against the model; returns {plain key: model tensor} to load."""
    linears = _linears(model)
    for name, layer in sorted(layers.items()):
        if name not in linears:
            raise CheckpointError(f"{layer.packed!r}: {name!r} is not a linear layer of "
                                  f"{type(model).__name__}.")
        if not scheme.quantizes(name):
            raise CheckpointError(f"{layer.packed!r}: the config does not quantize {name!r} "
                                  "(ignored or excluded), but the checkpoint holds it quantized.")
        n, k = linears[name].weight.shape
        _check_layer(layer, reader, names, n, k, scheme)
    for name in sorted(linears):
        if name not in layers and scheme.quantizes(name):
            raise CheckpointError(
                f"{name!r}: the config quantizes this layer, but the checkpoint has no NVFP4 "
                f"tensors for it (looked for "
                f"{name + ('.weight_packed' if scheme.writer == COMPRESSED_TENSORS else '.weight_scale_2')!r}).")
    used = {k for layer in layers.values() for k in layer[1:] if k is not None}
    return plain_tensors(model, reader, names, {f"{n}.weight" for n in layers}, used)


def _load(model, plain: dict, layers: dict[str, Layer], reader: Reader, scheme: Scheme,
          activations: str, device: torch.device) -> None:
    weights = {}
    for name, layer in layers.items():
        amax = _global_to_amax(layer, reader.get(layer.global_scale, "cpu"), scheme.writer)
        qdata, scale = reader.get(layer.packed, device), reader.get(layer.scale, device)
        act = NVFP4Spec() if scheme.inputs and activations == "dynamic" else None
        weights[name] = NVFP4Tensor.from_bytes(qdata, scale, amax.to(device),
                                               dtype=model.get_submodule(name).weight.dtype,
                                               act_spec=act)
    place(model, plain, {f"{name}.weight": w for name, w in weights.items()}, reader, device)
