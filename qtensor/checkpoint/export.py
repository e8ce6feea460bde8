"""Export for serving engines: NVFP4 in the compressed-tensors layout, MXFP4 in the gpt-oss
layout. Both write `model.safetensors` and `config.json` into a directory.

[Note: NVFP4 export]
compressed-tensors ("nvfp4-pack-quantized", read by vLLM) stores per linear layer NAME:
    NAME.weight_packed        uint8 [N, K/2]            E2M1 codes, element 2j in the low nibble
    NAME.weight_scale         float8_e4m3fn [N, K/16]   the block scales s_b, byte for byte
    NAME.weight_global_scale  float32 [1]               the ENCODE scale S_enc = r(6 B / A)
    NAME.input_global_scale   float32 [1]               same for the activation (static amax)
and a reader decodes value(q) * (s_b / global_scale). The global scale is thus the reciprocal of
the decode factor A / (6 B): for bound B = 256 it is 1536 / A instead of 2688 / A, so the bound
is absorbed and a reader that knows nothing of 4over6 or B = 256 decodes the same values. The
codes and block scales are exactly qtensor's bytes. The decoded fp32 values can differ from
qtensor's `dequantize` in the last bit, because qtensor rounds r(r(s_b A) r(1/(6B))) and the
reader r(s_b / S_enc) (docs/formats.md, NVFP4 step 7); the test measures how often.

[Note: MXFP4 export]
gpt-oss checkpoints store a weight NAME as NAME_blocks uint8 [..., K/32, 16] (32 E2M1 codes per
block, element 2j in the low nibble) and NAME_scales uint8 [..., K/32], the UE8M0 code e + 127
of the block exponent e of qtensor.formats.mxfp4; a reader decodes value(q) * 2**(code - 127).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import torch
from torch import nn

from qtensor.checkpoint.safetensors import save_file
from qtensor.checkpoint.schema import CheckpointError
from qtensor.formats import mxfp4
from qtensor.formats.elements import pack_fp4
from qtensor.formats.nvfp4 import encode_scale
from qtensor.tensors import NVFP4Tensor, QuantizedTensor

NVFP4_FORMAT = "nvfp4-pack-quantized"


def _fp4_args(dynamic) -> dict:
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
            "strategy": "tensor_group", "dynamic": dynamic, "actorder": None,
            "observer": None, "observer_kwargs": {}, "block_structure": None}


def nvfp4_tensors(name: str, w: NVFP4Tensor, input_amax: torch.Tensor | None) -> dict:
    """The compressed-tensors entries of one NVFP4 weight (see [Note: NVFP4 export])."""
    why = None
    if w.axis != "rowwise" or w.dim() != 2:
        why = f"a 2-D rowwise weight, got axis={w.axis} shape={tuple(w.shape)}"
    elif w.row_scaled:
        why = "one amax per tensor (the layout has one global scale), got row_scaled=True"
    elif w.rht:
        why = "no RHT (readers decode the codes as they are), got rht=True"
    if why:
        raise CheckpointError(f"{name!r}: NVFP4 export needs {why}. Requantize this layer or "
                              "leave it out of the export.")
    s_enc, _ = encode_scale(w.amax.float(), w.e4m3_bound)
    out = {
        f"{name}.weight_packed": w.qdata.contiguous(),
        f"{name}.weight_scale": w.scale.contiguous(),
        f"{name}.weight_global_scale": s_enc.reshape(1),
    }
    if input_amax is not None:
        spec = w.act_spec
        bound = spec.e4m3_bound if spec is not None else 448
        s_act, _ = encode_scale(input_amax.detach().float().reshape(()), bound)
        out[f"{name}.input_global_scale"] = s_act.reshape(1)
    return out


def export_nvfp4(
    model: nn.Module, directory: str | os.PathLike, *, config: Mapping | None = None,
    input_amax: Mapping[str, torch.Tensor] | None = None, weight_only: bool = False,
) -> dict:
    """Write an NVFP4-quantized model for serving; returns the config.json written.

    input_amax: {linear layer name: calibrated activation amax} (`calibrate_input_amax`
    measures it); needed when the weights carry an activation spec (a W4A4 model), since
    serving engines want one static activation global scale per layer. For a row-scaled
    activation spec that is a change of recipe, which passing input_amax asks for: the engine
    then quantizes each layer's activations with one static per-tensor scale instead of one
    per row. weight_only=True exports the weights alone (activations left to the engine)."""
    input_amax = dict(input_amax or {})
    tensors, ignore, act = {}, [], None
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, module in linears.items():
        w = module.weight
        if not isinstance(w, NVFP4Tensor):
            ignore.append(name)
            continue
        amax = None
        if w.act_spec is not None and not weight_only:
            if name not in input_amax:
                per_row = (" one amax per row," if w.act_spec.row_scaled else "")
                raise CheckpointError(
                    f"{name!r}: the weight quantizes its activation on the fly{per_row} "
                    f"({w.act_spec}); the serving layout needs a static per-tensor activation "
                    "amax. Pass input_amax={name: calibrated amax} (measure it with "
                    "qtensor.checkpoint.calibrate_input_amax(model, batches)), or "
                    "weight_only=True."
                )
            amax, act = input_amax.pop(name), _fp4_args("local")
        tensors.update(nvfp4_tensors(name, w, amax))
    if input_amax:
        raise CheckpointError(f"input_amax names layers with no NVFP4 weight: {sorted(input_amax)}.")
    done = {f"{n}.weight" for n in linears if n not in ignore}
    tensors.update(_plain_rest(model, done.__contains__))
    quant = {
        "quant_method": "compressed-tensors",
        "format": NVFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _fp4_args(False),
                                      "input_activations": act, "output_activations": None,
                                      "format": NVFP4_FORMAT}},
        "ignore": ignore,
    }
    return _write(directory, tensors, dict(config or {}), quant)


def calibrate_input_amax(model: nn.Module, batches, *, layers=None) -> dict[str, torch.Tensor]:
    """{layer name: fp32 0-d amax of its input over `batches`}: the static activation amax
    export_nvfp4 takes. Runs model(batch) for every batch (a tensor, or a tuple/dict of
    arguments) under torch.no_grad, recording max|input| of every nn.Linear whose weight is an
    NVFP4Tensor with an activation spec (or of the names in `layers`). Raises if a chosen layer
    saw no input."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if layers is None:
        chosen = [n for n, m in linears.items()
                  if isinstance(m.weight, NVFP4Tensor) and m.weight.act_spec is not None]
    else:
        chosen = list(layers)
        unknown = sorted(set(chosen) - set(linears))
        if unknown:
            raise ValueError(f"calibrate_input_amax: no nn.Linear named {unknown} in the model.")
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            a = args[0].detach().abs().amax().float()
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        return record

    handles = [linears[n].register_forward_pre_hook(hook(n)) for n in chosen]
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, dict):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(chosen) - set(amax))
    if missing:
        raise ValueError(f"calibrate_input_amax: layers {missing} saw no input in the batches.")
    return amax


def mxfp4_tensors(name: str, w: torch.Tensor) -> dict:
    """NAME_blocks / NAME_scales of one high-precision weight (see [Note: MXFP4 export])."""
    if isinstance(w, QuantizedTensor):
        raise CheckpointError(f"{name!r}: MXFP4 export takes the high-precision (QAT) weight; "
                              f"got a {type(w).__name__}.")
    if not torch.isfinite(w).all():
        raise CheckpointError(f"{name!r}: MXFP4 export needs finite weights (NaN/Inf found).")
    codes, e = mxfp4.decompose(w.detach())
    blocks = pack_fp4(codes).reshape(*codes.shape[:-1], codes.shape[-1] // 32, 16)
    return {f"{name}_blocks": blocks, f"{name}_scales": (e + 127).to(torch.uint8)}


def export_mxfp4(
    model: nn.Module, directory: str | os.PathLike, *, select: Callable[[str, torch.Tensor], bool],
    config: Mapping | None = None,
) -> dict:
    """Write the parameters that select(name, tensor) picks as MXFP4 blocks + scales (the
    values qtensor.formats.mxfp4.fake_quantize trained against), the rest as they are. An
    nn.Linear weight [N, K] is blocked along its last dim; any other parameter (an experts
    tensor [E, K, N] that enters `x @ W`) is stored transposed, blocked along K."""
    tensors, picked = {}, set()
    linear_weights = {f"{n}.weight" if n else "weight" for n, m in model.named_modules()
                      if isinstance(m, nn.Linear)}
    for key, t in model.state_dict().items():
        if select(key, t):
            if key not in linear_weights:
                # Any other parameter is the right operand of `x @ W` [.., K, N]: stored
                # transposed, blocks along K, as gpt-oss stores its experts and as
                # qtensor.from_pretrained reads them ([Note: reading gpt-oss MXFP4 checkpoints]).
                if t.dim() < 2:
                    raise CheckpointError(f"{key!r}: MXFP4 export takes a matrix; got shape "
                                          f"{tuple(t.shape)}.")
                t = t.transpose(-1, -2).contiguous()
            tensors.update(mxfp4_tensors(key, t))
            picked.add(key)
    if not picked:
        raise CheckpointError("export_mxfp4: select() picked no parameter.")
    tensors.update(_plain_rest(model, picked.__contains__))
    modules = sorted({n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
                     - {k.rsplit(".", 1)[0] for k in picked})
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": modules}
    return _write(directory, tensors, dict(config or {}), quant)


def _plain_rest(model: nn.Module, exported: Callable[[str], bool]) -> dict:
    out = {}
    for key, t in model.state_dict().items():
        if exported(key):
            continue
        if isinstance(t, QuantizedTensor):
            raise CheckpointError(f"{key!r}: a {type(t).__name__} has no layout in this export.")
        out[key] = t
    return out


def _write(directory, tensors: dict, config: dict, quant: dict) -> dict:
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quant
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config
