"""MXFP4QATConfig: quantize_(model, MXFP4QATConfig(host=...)) for MXFP4 weight QAT.

Registered with torchao's quantize_ handler registry (like qtensor/quantize.py), so
`torchao.quantization.quantize_(model, MXFP4QATConfig())` works too. Each selected nn.Linear
keeps its high-precision master weight as a trainable Parameter and becomes an MXFP4QATLinear:
its GEMMs see the MXFP4 projection of the weight in the host recipe's bytes (docs/qat.md).
This module imports torchao; `import qtensor` does not load it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import nn
import qtensor._torchao  # noqa: F401  (torchao without its import-time noise)
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from qtensor.backends import env
from qtensor.formats.fields import check_field_types
from qtensor.qat.hosts import Host
from qtensor.qat.linear import MXFP4QATLinear, check_weight
from qtensor.training.recipe import OVERRIDES

# QTENSOR_* variable -> config field; qtensor/backends/env.py declares their types and values.
ENV_VARS = {
    "QTENSOR_MXFP4_QAT_HOST": "host",
    "QTENSOR_MXFP4_QAT_DIRECT": "direct",
    "QTENSOR_MXFP4_QAT_BACKWARD_OVERRIDE": "backward_override",
}


@dataclasses.dataclass(frozen=True)
class MXFP4QATConfig(AOBaseConfig):
    """MXFP4 weight QAT on an MXFP8 or FP8 128x128 block-scaled training recipe."""

    # "mxfp8": every operand MXFP8 (1x32 UE8M0). "fp8_block128": DeepSeek-style FP8, 1x128
    # activations/gradients and 128x128 weights with fp32 power-of-two scales (native
    # torch._scaled_mm on sm_90+).
    host: str = "mxfp8"
    # Convert the MXFP4 decomposition straight into the host bytes instead of quantizing the
    # materialized projection again. Same GEMM results bit for bit; fewer passes over memory.
    direct: bool = False
    # None: quantized backward. "high_precision": dgrad and wgrad in the compute dtype on the
    # original weight and input. "dequantized": on the dequantized forward operands. Same
    # values and semantics as qtensor.training's recipe.
    backward_override: str | None = None
    # Add the weight gradient into `weight.main_grad` (fp32, Megatron-style) instead of .grad.
    fuse_wgrad_accumulation: bool = False
    # Run the FP8 block host's GEMMs natively (torch._scaled_mm) where the GPU has FP8 block
    # scaling (sm_90+) instead of the exact emulation (the reference). The native sums differ
    # from it by a few 1e-4 of the output's magnitude. Off by default: a compiled step with it
    # was not yet bitwise equal to the eager step on the GPU (docs/qat.md, "Status").
    native_gemm: bool = False
    # Leave layers whose shapes the host cannot take in high precision instead of raising.
    skip_incompatible: bool = False

    def __post_init__(self):
        check_field_types(self)
        hosts = tuple(h.value for h in Host)
        if self.host not in hosts:
            raise ValueError(f"host must be one of {hosts}; got {self.host!r}.")
        if self.backward_override not in OVERRIDES:
            raise ValueError(
                f"backward_override must be one of {OVERRIDES}; got {self.backward_override!r}."
            )
        for name in ("direct", "fuse_wgrad_accumulation", "native_gemm", "skip_incompatible"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}.")

    @property
    def host_enum(self) -> Host:
        return Host(self.host)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "MXFP4QATConfig":
        """Read QTENSOR_MXFP4_QAT_HOST / _DIRECT / _BACKWARD_OVERRIDE (docs/qat.md), parsed by
        qtensor/backends/env.py, from `environ` or the process environment as first read."""
        fields = {ENV_VARS[var]: value for var, value in env.read(ENV_VARS, environ).items()}
        fields.update(overrides)
        return cls(**fields)


def shape_error(module: nn.Linear, config: MXFP4QATConfig) -> str | None:
    """Why this layer's shape cannot take the host, or None."""
    n, k = module.weight.shape
    block = 32 if config.host_enum is Host.MXFP8 else 128
    if k % block or n % block:
        return (
            f"MXFP4 QAT on host {config.host!r} needs in_features and out_features divisible "
            f"by {block}; got {k} and {n}"
        )
    return None


@register_quantize_module_handler(MXFP4QATConfig)
def apply_qat(module: nn.Module, config: MXFP4QATConfig, name: str = "") -> nn.Module:
    """Turn one nn.Linear into an MXFP4QATLinear in place (its Parameters are kept)."""
    label = f"layer {name!r}" if name else f"layer {type(module).__name__}"
    if type(module) is not nn.Linear and not isinstance(module, MXFP4QATLinear):
        raise TypeError(
            f"MXFP4QATConfig applies to nn.Linear only; got {type(module).__name__} at {label}. "
            "Exclude it with filter_fn."
        )
    check_weight(module.weight, label)
    why = shape_error(module, config)
    if why:
        if config.skip_incompatible:
            return module
        raise ValueError(
            f"{why} at {label}. Exclude it with filter_fn, or pass skip_incompatible=True to "
            "leave such layers in high precision."
        )
    return MXFP4QATLinear.from_linear(module, config)


def quantize_(model: nn.Module, config: MXFP4QATConfig, filter_fn=None) -> nn.Module:
    """Apply MXFP4 QAT to every nn.Linear of `model` that filter_fn(module, name) selects."""
    if not isinstance(config, MXFP4QATConfig):
        raise TypeError(f"expected an MXFP4QATConfig; got {type(config).__name__}.")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and (filter_fn is None or filter_fn(module, name)):
            apply_qat(module, config, name)
    return model


torch.serialization.add_safe_globals([MXFP4QATConfig])
