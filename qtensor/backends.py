"""Backends: which code produces a tensor's bytes and which code multiplies it.

Both are chosen once (when a tensor is made, from its device and what is installed), stored on
the tensor as a plain string (so checkpoints stay loadable with weights_only=True) and shown in
its repr. Every feature has a pure-torch path, so everything runs on the CPU.
"""

from __future__ import annotations

import enum


class QuantBackend(str, enum.Enum):
    REFERENCE = "reference"  # pure torch, qtensor/formats: the spec in code
    CPU = "cpu"  # C++ kernels of csrc/
    CUDA = "cuda"  # CUDA kernels of csrc/


class GemmBackend(str, enum.Enum):
    EMULATED = "emulated"  # decode to exact fp32 units + torch matmul: the reference
    TRITON = "triton"  # decode in registers, bf16 tensor cores, fp32 accumulation
    SCALED_MM = "scaled_mm"  # native block-scaled torch._scaled_mm (sm_100+), never on Hopper
