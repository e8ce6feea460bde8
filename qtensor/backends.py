"""Backends: which code produces a tensor's bytes and which code multiplies it.

Both are chosen once (when a tensor is made, from its device and what is installed), stored on
the tensor as a plain string (so checkpoints stay loadable with weights_only=True) and shown in
its repr. Every feature has a pure-torch path, so everything runs on the CPU.
"""

from __future__ import annotations

import enum
import functools

import torch


class QuantBackend(str, enum.Enum):
    REFERENCE = "reference"  # pure torch, qtensor/formats: the spec in code
    CPU = "cpu"  # C++ kernels of csrc/
    CUDA = "cuda"  # CUDA kernels of csrc/


class GemmBackend(str, enum.Enum):
    EMULATED = "emulated"  # decode to exact fp32 units + torch matmul: the reference
    TRITON = "triton"  # decode in registers, bf16 tensor cores, fp32 accumulation
    SCALED_MM = "scaled_mm"  # native block-scaled torch._scaled_mm (sm_100+), never on Hopper


def compile_time_constant(fn):
    """Mark fn as torch.compile's `torch.compiler.assume_constant_result` does (Dynamo calls it
    at trace time and keeps its result as a constant), without importing Dynamo when qtensor
    is imported: the public function sets exactly this attribute, but importing it costs about
    a second. tests/test_compile_inference.py checks that the two agree."""
    fn._dynamo_marked_constant = True
    return fn


# The members by value. Code that torch.compile traces looks a backend up here rather than
# calling the Enum (Dynamo on torch 2.11 cannot trace Enum construction from a value).
QUANT_BACKENDS = {b.value: b for b in QuantBackend}
GEMM_BACKENDS = {b.value: b for b in GemmBackend}


# ---- GEMM backend resolution: once per tensor, when it is made or moved ----------------------

# Environment variable read once (GemmPolicy.from_env) to force a backend for new tensors.
GEMM_BACKEND_ENV = "QTENSOR_GEMM_BACKEND"


def gemm_backend_problem(backend: GemmBackend, device) -> str | None:
    """Why `backend` cannot multiply tensors on `device`, or None when it can."""
    import torch

    device = torch.device(device)
    if backend is GemmBackend.EMULATED:
        return None
    if device.type != "cuda":
        return f"{backend.value} needs a CUDA device; the tensor is on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if backend is GemmBackend.TRITON:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "the triton backend needs Triton installed"
        if major < 8:
            return f"the triton backend needs bf16 tensor cores (sm_80+); got sm_{major}{minor}"
        return None
    if major < 10 or not hasattr(torch, "float4_e2m1fn_x2"):
        return (
            "scaled_mm needs block-scaled FP4/FP8 tensor cores (sm_100+) and torch with "
            f"float4_e2m1fn_x2; got sm_{major}{minor} (Hopper runs the triton backend)"
        )
    return None


class GemmPolicy:
    """The process-wide backend override, read from the environment once (at first use)."""

    _current: "GemmPolicy | None" = None

    def __init__(self, override: GemmBackend | None):
        self.override = override

    @classmethod
    def from_env(cls) -> "GemmPolicy":
        import os

        value = os.environ.get(GEMM_BACKEND_ENV, "").strip()
        if not value:
            return cls(None)
        try:
            return cls(GemmBackend(value))
        except ValueError:
            names = ", ".join(b.value for b in GemmBackend)
            raise ValueError(f"{GEMM_BACKEND_ENV} must be one of {names}; got {value!r}.") from None

    @classmethod
    def current(cls) -> "GemmPolicy":
        if cls._current is None:
            cls._current = cls.from_env()
        return cls._current


def resolve_gemm_backend(device, override: GemmBackend | str | None = None) -> GemmBackend:
    """The backend a tensor on `device` multiplies with: the explicit override, else the
    environment's, else the fastest one available (scaled_mm on sm_100+, triton on sm_80+ CUDA
    with Triton installed, emulated otherwise). An override that cannot run there raises."""
    if override is None:
        name = _env_override_name()
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
# traced, GemmPolicy.current() would guard on the policy being unset and recompile once it is.
@compile_time_constant
def _env_override_name() -> str | None:
    override = GemmPolicy.current().override
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
