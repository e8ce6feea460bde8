"""quantize_(model, config): swap nn.Linear weights for quantized tensors, torchao-style.

The configs are registered with torchao's handler registry, so
`torchao.quantization.quantize_(model, config)` takes them too. Weight-only configs keep the
activation in high precision (F.linear multiplies it by the decoded weight, exactly); dynamic
configs store the activation's spec on the weight, and F.linear quantizes the activation with it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, ClassVar

import torch
from torch import nn
import qtensor._torchao  # noqa: F401  (torchao without its import-time noise)
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from qtensor.formats.fields import check_field_types, either
from qtensor.formats.mxfp4 import MXFP4Spec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.tensors import QuantizedTensor, quantize_spec, to_decode_layout
from qtensor.tensors.decode import pack_problem
from qtensor.tensors.common import NonFiniteInputError

FilterFn = Callable[[nn.Module, str], bool]


def _check_inference_spec(spec, role: str) -> None:
    if spec.columnwise:
        raise ValueError(f"The {role} spec must be rowwise (columnwise=False) for F.linear.")
    if isinstance(spec, NVFP4Spec) and (spec.rht or spec.stochastic_rounding):
        raise ValueError(
            f"RHT and stochastic rounding are gradient (training) options; the {role} spec of "
            "an inference config must not set them."
        )


class _InferenceConfig(AOBaseConfig):
    """Validation and spec access shared by the inference configs (each a frozen dataclass
    with a `weight` spec, an optional `activation` spec and `skip_incompatible`)."""

    spec_type: ClassVar[type]

    def __post_init__(self):
        check_field_types(self)
        for role in ("weight", "activation"):
            spec = getattr(self, role, None)
            if role == "activation" and spec is None:
                continue
            if not isinstance(spec, self.spec_type):
                raise TypeError(
                    f"{type(self).__name__}.{role} takes an {self.spec_type.__name__}; got "
                    f"{type(spec).__name__}."
                )
            _check_inference_spec(spec, role)
        if getattr(getattr(self, "activation", None), "block_2d", False):
            raise ValueError("2D (16x16) blocks are for weights; set activation.block_2d=False.")
        layout = getattr(self, "layout", "auto")
        if layout not in LAYOUTS:
            raise ValueError(f"{type(self).__name__}.layout is {either(LAYOUTS)}; got {layout!r}.")

    def specs(self):
        return self.weight, getattr(self, "activation", None)


# How a weight-only config stores its weights ([Note: decode weights] in qtensor/tensors/decode.py):
# "auto" packs them into the decode layout where the decode GEMM kernel is built for their
# device (qtensor.ops.decode_mm.device_kernel_problem), "decode" packs them on every device
# (where no kernel exists each product unpacks the weight and runs the canonical product) and
# refuses a weight the layout cannot hold, "canonical" never packs.
LAYOUTS = ("auto", "decode", "canonical")


@dataclasses.dataclass(frozen=True)
class NVFP4WeightOnlyConfig(_InferenceConfig):
    """NVFP4 weights, high-precision activations."""

    spec_type: ClassVar[type] = NVFP4Spec
    weight: NVFP4Spec = NVFP4Spec()
    # Leave layers whose shapes NVFP4 cannot take in high precision instead of raising.
    skip_incompatible: bool = False
    layout: str = "auto"


@dataclasses.dataclass(frozen=True)
class NVFP4DynamicActivationNVFP4WeightConfig(_InferenceConfig):
    """NVFP4 weights and activations quantized on the fly (row-scaled and 4over6 allowed)."""

    spec_type: ClassVar[type] = NVFP4Spec
    weight: NVFP4Spec = NVFP4Spec()
    activation: NVFP4Spec = NVFP4Spec()
    skip_incompatible: bool = False


@dataclasses.dataclass(frozen=True)
class MXFP8WeightOnlyConfig(_InferenceConfig):
    """MXFP8 weights, high-precision activations."""

    spec_type: ClassVar[type] = MXFP8Spec
    weight: MXFP8Spec = MXFP8Spec()
    skip_incompatible: bool = False
    layout: str = "auto"


@dataclasses.dataclass(frozen=True)
class MXFP4WeightOnlyConfig(_InferenceConfig):
    """MXFP4 weights (OCP MX: E2M1 codes, a UE8M0 scale per 32), high-precision activations."""

    spec_type: ClassVar[type] = MXFP4Spec
    weight: MXFP4Spec = MXFP4Spec()
    skip_incompatible: bool = False
    layout: str = "auto"


@dataclasses.dataclass(frozen=True)
class MXFP8DynamicActivationMXFP8WeightConfig(_InferenceConfig):
    """MXFP8 weights and activations quantized on the fly."""

    spec_type: ClassVar[type] = MXFP8Spec
    weight: MXFP8Spec = MXFP8Spec()
    activation: MXFP8Spec = MXFP8Spec()
    skip_incompatible: bool = False


CONFIGS = (
    NVFP4WeightOnlyConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    MXFP8WeightOnlyConfig,
    MXFP8DynamicActivationMXFP8WeightConfig,
    MXFP4WeightOnlyConfig,
)


def linear_shape_error(module: nn.Linear, config) -> str | None:
    """Why this layer's shape cannot take the config, or None."""
    weight_spec, _ = config.specs()
    n, k = module.weight.shape
    block = 16 if isinstance(weight_spec, NVFP4Spec) else 32
    fmt = {NVFP4Spec: "NVFP4", MXFP8Spec: "MXFP8", MXFP4Spec: "MXFP4"}[type(weight_spec)]
    if k % block:
        return f"{fmt} needs in_features divisible by {block}; got {k}"
    if getattr(weight_spec, "block_2d", False) and n % 16:
        return f"NVFP4 2D blocks need out_features divisible by 16; got {n}"
    return None


def quantize_linear(module: nn.Linear, config, name: str = "") -> nn.Module:
    """Replace module.weight with its quantized form (in place); returns the module."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{type(config).__name__} applies to nn.Linear; got {type(module).__name__}.")
    why = linear_shape_error(module, config)
    if why:
        if config.skip_incompatible:
            return module
        label = f"layer {name!r}" if name else f"layer {module}"
        raise ValueError(
            f"{why} at {label}. Exclude it with filter_fn, or pass skip_incompatible=True to "
            "leave such layers in high precision."
        )
    weight_spec, act_spec = config.specs()
    label = f"layer {name!r}" if name else f"layer {module}"
    if isinstance(module.weight, QuantizedTensor):
        raise TypeError(
            f"{label} is already quantized ({type(module.weight).__name__}); quantize_ takes "
            "the high-precision model. Load the original weights, or skip this layer with "
            "filter_fn."
        )
    with torch.no_grad():
        try:
            w = quantize_spec(module.weight.detach(), weight_spec)
        except NonFiniteInputError as e:
            raise NonFiniteInputError(
                f"{label}: the weight has {e.count} non-finite value(s) (NaN or Inf). Fix the "
                "checkpoint, exclude the layer with filter_fn, or quantize the weight yourself "
                "with check_finite=False (NVFP4Tensor.from_hp / MXFP8Tensor.from_hp) to get the "
                "documented hardware rule (docs/formats.md).", e.count) from None
    if act_spec is not None:
        w = w.replace(act_spec=act_spec)
    module.weight = nn.Parameter(w, requires_grad=False)
    layout = getattr(config, "layout", "canonical")
    if _packs(layout, w) and not to_decode_layout(module) and layout == "decode":
        raise ValueError(f"{label}: layout='decode' cannot pack its weight: {pack_problem(w)}. "
                         "Use layout='auto' to keep such weights canonical.")
    module.extra_repr = _extra_repr.__get__(module)
    return module


def _packs(layout: str, w) -> bool:
    """Whether a weight-only config's `layout` packs this weight into the decode layout."""
    if layout == "auto":
        from qtensor.ops.decode_mm import device_kernel_problem

        return device_kernel_problem(w.device, w.gemm_format) is None
    return layout == "decode"


def _extra_repr(self) -> str:
    return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight!r}"


for _cfg in CONFIGS:
    register_quantize_module_handler(_cfg)(quantize_linear)


def _is_linear(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear)


def _is_candidate(module: nn.Module) -> bool:
    """Modules a qtensor config can transform; filter_fn chooses among these."""
    from qtensor.training.grouped import GroupedLinear

    return isinstance(module, (nn.Linear, GroupedLinear))


def _handler(config: AOBaseConfig):
    """The module transform registered for this config type (ours, training, QAT, or torchao's)."""
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER

    if isinstance(config, type):
        raise TypeError(
            f"quantize_ takes a config instance; got the class {config.__name__}. Pass "
            f"{config.__name__}() (with its options)."
        )
    handler = _QUANTIZE_CONFIG_HANDLER.get(type(config))
    if handler is None or not type(config).__module__.startswith("qtensor."):
        names = ", ".join(c.__name__ for c in CONFIGS)
        raise TypeError(
            f"quantize_ takes one of {names}, TrainingConfig or MXFP4QATConfig; got "
            f"{type(config).__name__}. Use torchao.quantization.quantize_ for torchao's configs."
        )
    return handler


def quantize_(model: nn.Module, config: AOBaseConfig, filter_fn: FilterFn | None = None) -> nn.Module:
    """Apply `config` to every nn.Linear (or GroupedLinear) that filter_fn(module, name) selects.

    Like torchao's quantize_, but layer names reach the transforms, so shape errors name the
    layer. Transforms that return a new module (training, QAT) replace it in its parent.
    """
    handler = _handler(config)
    takes_name = "name" in inspect.signature(handler).parameters
    filter_fn = filter_fn or _is_linear
    modules = dict(model.named_modules())
    tied = _tied_parameter_names(model)
    for name, module in list(modules.items()):
        if not (_is_candidate(module) and filter_fn(module, name)):
            continue
        _warn_if_tied(name, module, tied)
        new = handler(module, config, name=name) if takes_name else handler(module, config)
        if new is not module:
            if not name:
                raise ValueError("quantize_ cannot replace the root module; pass its parent.")
            parent_name, _, child = name.rpartition(".")
            setattr(modules[parent_name], child, new)
    return model


__all__ = [c.__name__ for c in CONFIGS] + ["quantize_"]


def _tied_parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> its names, for parameters reachable under several names (tied)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {k: v for k, v in names.items() if len(v) > 1}


def _warn_if_tied(name: str, module: nn.Module, tied: dict[int, list[str]]) -> None:
    weight = getattr(module, "weight", None)
    shared = tied.get(id(weight))
    if shared:
        import warnings

        own = f"{name}.weight" if name else "weight"
        others = [n for n in shared if n != own]
        warnings.warn(
            f"layer {name!r}'s weight is tied to {others}; quantizing the layer unties them: "
            f"{others} keep the high-precision weight and {name!r} gets a quantized copy (more "
            "memory, and training updates no longer reach both). Exclude the layer with "
            f"filter_fn (e.g. lambda m, n: n != {name!r}) to keep them tied.",
            stacklevel=3,
        )
