"""Backend choice: which code produces a tensor's bytes and which code multiplies it.

Both are chosen once (when a tensor is made, from its device, what is installed and the
process-wide policy), stored on the tensor as a plain string (so checkpoints stay loadable with
weights_only=True) and shown in its repr. Every feature has a pure-torch path, so everything
runs on the CPU.

[Note: quantization backends] The quantize backend is chosen once per device type: the CUDA
kernels on a GPU, the C++ kernels on the CPU, the pure-torch reference of qtensor/formats when
the extension is not built or the policy forces it (QTENSOR_QUANT_BACKEND=reference). Every
backend produces the same bytes: the kernels are tested bit for bit against the reference.
MXFP4 QAT narrows that choice to the reference where the loaded extension lacks its two ops.

Functions marked `compile_time_constant` are called by torch.compile at trace time and their
results kept as constants (a str, or an Enum member where noted): the choice is made once and
never guarded on, and a compiled graph keeps the choice it was traced with.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from qtensor.backends.extension import EXTENSION_ERROR, has_kernel
from qtensor.backends.kinds import (GEMM_BACKENDS, QUANT_BACKENDS, GemmBackend, QuantBackend,
                                    ScaledMMFormat, compile_time_constant)
from qtensor.backends.policy import current_policy, depends_on_policy

# ---- the quantize backend: once per device type ------------------------------------------------


def quant_backend(device: torch.device | str) -> QuantBackend:
    """The backend that quantizes tensors on `device` (chosen once per device type)."""
    return QUANT_BACKENDS[_quant_backend_name(torch.device(device).type)]


# Chosen once: torch.compile calls it at trace time and keeps the result as a constant (a str:
# an Enum returned from here would become an opaque object in the graph).
@compile_time_constant
def _quant_backend_name(device_type: str) -> str:
    return _quant_backend_for(device_type, current_policy().force_quant_reference).value


@depends_on_policy
@functools.cache
def _quant_backend_for(device_type: str, force_reference: bool) -> QuantBackend:
    if force_reference or EXTENSION_ERROR is not None:
        return QuantBackend.REFERENCE
    if device_type == "cpu":
        return QuantBackend.CPU
    if device_type == "cuda" and has_kernel("nvfp4_quantize", "CUDA"):
        return QuantBackend.CUDA
    return QuantBackend.REFERENCE


# The fused MXFP4 QAT ops (qtensor/qat/kernels.py); an extension built from an older tree may
# lack them.
QAT_OPS = ("mxfp4_qat_mxfp8", "mxfp4_qat_fp8_block")
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def qat_quant_backend(device_type: str) -> QuantBackend:
    """The project's choice for this device type (`quant_backend`: extension built, policy),
    narrowed to REFERENCE when the loaded extension lacks the QAT ops for the device."""
    return QUANT_BACKENDS[_qat_quant_backend_name(device_type)]


# Chosen once, kept by torch.compile as a constant str (the tensors it feeds store `.value`,
# which Dynamo cannot read off an Enum returned from a constant function).
@compile_time_constant
def _qat_quant_backend_name(device_type: str) -> str:
    return _qat_backend_for(device_type, quant_backend(device_type)).value


@depends_on_policy
@functools.lru_cache(maxsize=None)
def _qat_backend_for(device_type: str, project_choice: QuantBackend) -> QuantBackend:
    if project_choice is QuantBackend.REFERENCE:
        return QuantBackend.REFERENCE
    key = _DISPATCH_KEY[device_type]
    if not all(has_kernel(name, key) for name in QAT_OPS):
        return QuantBackend.REFERENCE
    return project_choice


# ---- the GEMM backend: once per tensor, when it is made or moved -------------------------------


def gemm_backend_problem(backend: GemmBackend, device,
                         scaled_format: ScaledMMFormat = ScaledMMFormat.MX_BLOCK) -> str | None:
    """Why `backend` cannot multiply tensors on `device`, or None when it can. For SCALED_MM the
    answer depends on the operands' format: block-scaled MX/NVFP4 needs sm_100+ (and torch with
    float4_e2m1fn_x2), FP8 with 1x128 / 128x128 fp32 block scales runs on sm_90+."""
    device = torch.device(device)
    if backend is GemmBackend.EMULATED:
        return None
    if device.type != "cuda":
        return f"{backend.value} needs a CUDA device; the tensor is on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if backend is GemmBackend.TRITON:
        if importlib.util.find_spec("triton") is None:
            return "the triton backend needs Triton installed"
        if major < 8:
            return f"the triton backend needs bf16 tensor cores (sm_80+); got sm_{major}{minor}"
        return None
    if scaled_format is ScaledMMFormat.FP8_BLOCK128:
        if major < 9:
            return (f"scaled_mm on FP8 with 1x128 / 128x128 fp32 block scales needs FP8 tensor "
                    f"cores (sm_90+); got sm_{major}{minor}")
        return None
    if major < 10 or not hasattr(torch, "float4_e2m1fn_x2"):
        return (
            "scaled_mm needs block-scaled FP4/FP8 tensor cores (sm_100+) and torch with "
            f"float4_e2m1fn_x2; got sm_{major}{minor} (Hopper runs the triton backend)"
        )
    return None


def resolve_gemm_backend(device, override: GemmBackend | str | None = None) -> GemmBackend:
    """The backend a tensor on `device` multiplies with: the explicit override, else the
    policy's (QTENSOR_GEMM_BACKEND), else the fastest one available (scaled_mm on sm_100+, triton
    on sm_80+ CUDA with Triton installed, emulated otherwise). An override that cannot run there
    raises."""
    if override is None:
        name = _policy_override_name()
        override = GEMM_BACKENDS[name] if name is not None else None
    device = torch.device(device)
    if override is not None:
        backend = GemmBackend(override)
        problem = gemm_backend_problem(backend, device)
        if problem:
            raise ValueError(f"GEMM backend {backend.value!r} is not available: {problem}.")
        return backend
    if device.type != "cuda":
        return GemmBackend.EMULATED
    index = device.index if device.index is not None else torch.cuda.current_device()
    return GEMM_BACKENDS[_fastest_cuda_backend_name(index)]


# The process-wide override (read from the environment once) as a compile-time constant:
# traced, current_policy() would guard on the policy being unset and recompile once it is.
@compile_time_constant
def _policy_override_name() -> str | None:
    override = current_policy().gemm_override
    return override.value if override is not None else None


# torch.compile calls it at trace time and keeps the result, a str, as a constant (marked on a
# plain function: Dynamo looks through an lru_cache wrapper and would trace the probe).
@compile_time_constant
def _fastest_cuda_backend_name(index: int) -> str:
    return _fastest_cuda_backend(index)


# Cached per device: activations are quantized (and their backend resolved) every forward.
@functools.lru_cache(maxsize=None)
def _fastest_cuda_backend(index: int) -> str:
    for backend in (GemmBackend.SCALED_MM, GemmBackend.TRITON):
        if gemm_backend_problem(backend, f"cuda:{index}") is None:
            return backend.value
    return GemmBackend.EMULATED.value


# ---- the GEMM backend of an MXFP4 QAT host ------------------------------------------------------


def qat_gemm_backend(native_format: ScaledMMFormat | None, device: torch.device,
                     native: bool = False) -> GemmBackend:
    """Chosen once per (format, device, native): SCALED_MM when the native GEMM is asked for
    (`native`, MXFP4QATConfig.native_gemm, opt-in) and the host has one (`native_format`: the
    FP8 block host's, on sm_90+; None for a host with none), else exact emulation."""
    fmt = native_format.value if native_format is not None else None
    return GEMM_BACKENDS[_qat_gemm_backend_name(fmt, device.type, device.index, native)]


# Chosen once: torch.compile calls it at trace time and keeps the result (a str) as a constant.
@compile_time_constant
def _qat_gemm_backend_name(native_format: str | None, device_type: str, index: int | None,
                           native: bool) -> str:
    return _choose_qat_gemm_backend(native_format, device_type, index, native).value


@functools.lru_cache(maxsize=None)
def _choose_qat_gemm_backend(native_format: str | None, device_type: str, index: int | None,
                             native: bool) -> GemmBackend:
    if native and native_format is not None and device_type == "cuda":
        device = torch.device("cuda", index) if index is not None else torch.device("cuda")
        if gemm_backend_problem(GemmBackend.SCALED_MM, device,
                                ScaledMMFormat(native_format)) is None:
            return GemmBackend.SCALED_MM
    return GemmBackend.EMULATED
