"""Numerics report: what each quantization config does to a model, layer by layer.

For every config: the model-level output SQNR against the high-precision model, and per
nn.Linear the weight SQNR, the output SQNR of that layer alone (its recorded high-precision
input through the quantized weight, against the fp32 product), the 4over6 map-to-4 fraction of
its weight and activation blocks, and a histogram of its block-scale exponents. The command
line (`qtensor analyze`, `qtensor demo`) prints and plots these; this module only measures.

SQNR is 10 log10(sum ref^2 / sum (ref - test)^2) in dB, accumulated in fp64: +6 dB is one more
bit of agreement. Every quantizer here is the reference of qtensor.formats, never a copy.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qtensor.formats import nvfp4
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.tensors import QuantizedTensor

RunFn = Callable[[nn.Module], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class NamedConfig:
    name: str  # what the command line calls it
    description: str
    config: Any  # a config of qtensor.quantize (an AOBaseConfig)


def builtin_configs() -> list[NamedConfig]:
    """Every config of qtensor.quantize, with the option sets the demo shows (loads torchao)."""
    from qtensor import quantize as q

    fourover6 = NVFP4Spec(fourover6="mae", e4m3_bound=256)
    return [
        NamedConfig("nvfp4-weight", "NVFP4 weights, bf16 activations", q.NVFP4WeightOnlyConfig()),
        NamedConfig("nvfp4", "NVFP4 weights and activations",
                    q.NVFP4DynamicActivationNVFP4WeightConfig()),
        NamedConfig("nvfp4-4over6", "NVFP4 W+A, 4over6 (MAE, bound 256) on both",
                    q.NVFP4DynamicActivationNVFP4WeightConfig(weight=fourover6,
                                                              activation=fourover6)),
        NamedConfig("nvfp4-rowscaled", "NVFP4 W+A, row-scaled (per-token) activation amax",
                    q.NVFP4DynamicActivationNVFP4WeightConfig(activation=NVFP4Spec(row_scaled=True))),
        NamedConfig("mxfp8-weight", "MXFP8 weights, bf16 activations", q.MXFP8WeightOnlyConfig()),
        NamedConfig("mxfp8", "MXFP8 weights and activations",
                    q.MXFP8DynamicActivationMXFP8WeightConfig()),
    ]


def select_configs(names: Iterable[str] | None) -> list[NamedConfig]:
    """The built-in configs named (all when names is None), in the order given."""
    known = {c.name: c for c in builtin_configs()}
    if names is None:
        return list(known.values())
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"Unknown config name(s) {unknown or names}; choose from {', '.join(known)}."
        )
    return [known[n] for n in names]


# ---- metrics ------------------------------------------------------------------------------------


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - test|^2) in fp64; inf when test equals ref exactly."""
    r, t = ref.double(), test.double()
    noise = (r - t).pow(2).sum().item()
    signal = r.pow(2).sum().item()
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor stores: a quantized tensor's inner tensors (qdata, scale, amax, ...)."""
    if isinstance(t, QuantizedTensor):
        return sum(stored_bytes(getattr(t, n)) for n in t.tensor_data_names
                   if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def quantized_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(stored bytes of the quantized Linear weights, bytes of the same weights in bf16)."""
    stored = bf16 = 0
    for _, module in linear_layers(model):
        if isinstance(module.weight, QuantizedTensor):
            stored += stored_bytes(module.weight)
            bf16 += module.weight.numel() * 2
    return stored, bf16


def scale_exponent_histogram(scale: torch.Tensor) -> dict[int, int]:
    """{floor(log2 s): count} over the block scales (E4M3 or UE8M0); key -1000 counts zeros."""
    s = scale.float().flatten()
    zeros = int((s == 0).sum())
    exps, counts = torch.unique(torch.floor(torch.log2(s[s > 0])).long(), return_counts=True)
    hist = {int(e): int(c) for e, c in zip(exps.tolist(), counts.tolist(), strict=True)}
    if zeros:
        hist[ZERO_SCALE] = zeros
    return hist


ZERO_SCALE = -1000  # histogram key of all-zero blocks (scale 0 has no exponent)


# ---- per-layer and model-level analysis ----------------------------------------------------------


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


@dataclasses.dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    weight_sqnr_db: float
    output_sqnr_db: float
    weight_map4_fraction: float | None  # None when the weight spec has no 4over6
    activation_map4_fraction: float | None
    scale_histogram: dict[int, int]  # of the weight's block scales


@dataclasses.dataclass
class ConfigReport:
    name: str
    description: str
    model_sqnr_db: float
    weight_bytes: int  # stored bytes of the quantized Linear weights
    bf16_weight_bytes: int  # the same weights in bf16
    layers: list[LayerReport]
    skipped: list[str]  # layers left in high precision (shape the format cannot take)


@dataclasses.dataclass
class Report:
    model: str
    dtype: str
    input_shape: tuple[int, ...]
    configs: list[ConfigReport]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def shape_errors(model: nn.Module, config) -> list[tuple[str, str]]:
    """(layer name, why) for every Linear whose shape the config's format cannot take."""
    from qtensor.quantize import linear_shape_error

    found = []
    for name, module in linear_layers(model):
        why = linear_shape_error(module, config)
        if why:
            found.append((name, why))
    return found


def record_linear_inputs(model: nn.Module,
                         run: RunFn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the model once; return its output and the input each Linear saw (first call)."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in linear_layers(model):
        def hook(mod, args, name=name):
            inputs.setdefault(name, args[0].detach())
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            out = run(model)
    finally:
        for h in hooks:
            h.remove()
    return out, inputs


def _map4_fraction(x: torch.Tensor, spec) -> float | None:
    if not isinstance(spec, NVFP4Spec) or not spec.fourover6:
        return None
    return nvfp4.fourover6_map4(x.reshape(-1, x.shape[-1]), spec).float().mean().item()


def layer_report(name: str, w: torch.Tensor, qw: QuantizedTensor, x: torch.Tensor | None,
                 config) -> LayerReport:
    """Metrics of one quantized Linear weight qw (from w) on its recorded input x."""
    weight_spec, act_spec = config.specs()
    with torch.no_grad():
        w_sqnr = sqnr_db(w.float(), qw.dequantize(torch.float32))
        out_sqnr, act_map4 = math.nan, None
        if x is not None:
            out_sqnr = sqnr_db(F.linear(x.float(), w.float()), F.linear(x, qw).float())
            act_map4 = _map4_fraction(x, act_spec)
        return LayerReport(
            name=name,
            shape=tuple(w.shape),
            weight_sqnr_db=w_sqnr,
            output_sqnr_db=out_sqnr,
            weight_map4_fraction=_map4_fraction(w, weight_spec),
            activation_map4_fraction=act_map4,
            scale_histogram=scale_exponent_histogram(qw.scale),
        )


def quantized_copy(model: nn.Module, named: NamedConfig, skip_incompatible: bool) -> nn.Module:
    """A deep copy of model quantized with the config; raises naming the first bad layer."""
    from qtensor.quantize import quantize_

    bad = shape_errors(model, named.config)
    if bad and not skip_incompatible:
        name, why = bad[0]
        raise ValueError(
            f"Config {named.name!r} cannot take layer {name!r}: {why} ({len(bad)} such "
            "layer(s)). Skip them with skip_incompatible=True (--skip-incompatible)."
        )
    config = dataclasses.replace(named.config, skip_incompatible=skip_incompatible)
    qmodel = copy.deepcopy(model)
    quantize_(qmodel, config)
    return qmodel


def analyze_config(model, named: NamedConfig, run: RunFn, ref_out, inputs, *,
                   skip_incompatible=False, progress=None) -> ConfigReport:
    qmodel = quantized_copy(model, named, skip_incompatible)
    with torch.no_grad():
        model_sqnr = sqnr_db(ref_out.float(), run(qmodel).float())
    _tick(progress, f"{named.name}: model")
    originals = dict(linear_layers(model))
    layers, skipped = [], []
    for name, module in linear_layers(qmodel):
        if isinstance(module.weight, QuantizedTensor):
            w = originals[name].weight
            layers.append(layer_report(name, w, module.weight, inputs.get(name), named.config))
        else:
            skipped.append(name)
        _tick(progress, f"{named.name}: {name}")
    stored, bf16 = quantized_weight_bytes(qmodel)
    return ConfigReport(named.name, named.description, model_sqnr, stored, bf16, layers, skipped)


def _tick(progress, label: str) -> None:
    if progress is not None:
        progress.set_postfix_str(label, refresh=False)
        progress.update(1)


def analyze(model: nn.Module, run: RunFn, configs: list[NamedConfig], *, model_name: str,
            input_shape: tuple[int, ...], skip_incompatible: bool = False,
            progress=None) -> Report:
    """Quantize copies of `model` with each config and measure them against `model`.

    `run(model)` returns the output to compare (e.g. logits); `progress` is a tqdm-like bar
    advanced once for the model and once per Linear, per config.
    """
    ref_out, inputs = record_linear_inputs(model, run)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    reports = [
        analyze_config(model, named, run, ref_out, inputs, skip_incompatible=skip_incompatible,
                       progress=progress)
        for named in configs
    ]
    return Report(model_name, dtype, tuple(input_shape), reports)


def progress_steps(model: nn.Module, configs: list[NamedConfig]) -> int:
    return len(configs) * (1 + len(linear_layers(model)))


# ---- Hugging Face models ------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def load_hf_causal_lm(path: str | Path, *, dtype=torch.bfloat16, seed: int = 0) -> nn.Module:
    """A transformers causal LM from a local directory, never a download.

    With weights in the directory they are loaded; with only a config.json the model is built
    from it with seeded random weights (enough to see what a format does to its shapes).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model needs a local directory holding a Hugging Face config.json (and optionally "
            f"its weights); got {str(path)!r}. Save one with config.save_pretrained(dir)."
        )
    import transformers  # optional: the caller turns ModuleNotFoundError into a remedy

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if any((path / f).is_file() for f in _WEIGHT_FILES):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    else:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


__all__ = [
    "ConfigReport", "LayerReport", "NamedConfig", "Report", "analyze", "builtin_configs",
    "linear_layers", "load_hf_causal_lm", "quantized_weight_bytes", "scale_exponent_histogram",
    "select_configs", "sqnr_db", "stored_bytes",
]
