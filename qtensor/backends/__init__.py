"""Backends: what is built, what the process asks for, and which code runs each op.

Below tensors/, ops/ and kernels/ (it imports only torch and the standard library), one module
per concern, each importing only those listed before it:
    env.py        every QTENSOR_* variable, its parser, the one reader of the environment
    kinds.py      QuantBackend, GemmBackend, ScaledMMFormat, compile_time_constant
    extension.py  loading qtensor._C, why it failed, which kernels it holds
    policy.py     BackendPolicy: the process-wide choices, from the environment once
    choice.py     the quantize, QAT and GEMM backend of a device, chosen once
"""

from qtensor.backends import env
from qtensor.backends.choice import (QAT_OPS, gemm_backend_problem, qat_gemm_backend,
                                     qat_quant_backend, quant_backend, resolve_gemm_backend)
from qtensor.backends.extension import EXTENSION_ERROR, extension_status, has_kernel, has_ops
from qtensor.backends.kinds import (GEMM_BACKENDS, QUANT_BACKENDS, GemmBackend, QuantBackend,
                                    ScaledMMFormat, compile_time_constant)
from qtensor.backends.policy import BackendPolicy, current_policy, set_policy

__all__ = [
    "BackendPolicy",
    "EXTENSION_ERROR",
    "GEMM_BACKENDS",
    "GemmBackend",
    "QAT_OPS",
    "QUANT_BACKENDS",
    "QuantBackend",
    "ScaledMMFormat",
    "compile_time_constant",
    "current_policy",
    "env",
    "extension_status",
    "gemm_backend_problem",
    "has_kernel",
    "has_ops",
    "qat_gemm_backend",
    "qat_quant_backend",
    "quant_backend",
    "resolve_gemm_backend",
    "set_policy",
]
