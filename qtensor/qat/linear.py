"""MXFP4QATLinear: an nn.Linear whose GEMMs see its weight's MXFP4 projection in host bytes.

[Note: QAT linear dataflow]
The module runs the training stack's autograd linear (qtensor/training/linear.py,
TrainingLinearFunction) with the host's operand specs ([Note: QAT hosts] in hosts.py); only the
weight's operand comes from the MXFP4 transform, cached in the training WeightCache:
    fprop  Y  = X @ W^T    X host-rowwise            x  weight operand (MXFP4 -> host)
    dgrad  dX = dY @ W     None: dY host-rowwise     x  weight operand's dgrad usage
                           "dequantized": dY         x  dequantize(weight operand) = w^
                           "high_precision": dY      x  the master weight W
    wgrad  dW = dY^T @ X   None: dY host-columnwise  x  X host-columnwise
                           "dequantized": dY^T       x  dequantize(X host-rowwise)
                           "high_precision": dY^T    x  X
The weight's dgrad usage is, on the MXFP8 host, a fresh 32x1 MXFP8 quantization of w^; on the
FP8 block host the same 128x128 tiles as fprop (a square tile transposes exactly). dW is the
gradient with respect to w^ handed unchanged to W: the straight-through estimator. High-
precision GEMMs run in the compute dtype (the input's, or autocast's); quantized ones on exact
decoded values. The bias is added in fp32 as stored. fp16 is rejected: the MXFP4 grid spans
2**-127 .. 6 * 2**125.
"""

from __future__ import annotations

import torch
from torch import nn

from qtensor.backends import GemmBackend
from qtensor.qat import hosts
from qtensor.qat.hosts import Host
from qtensor.tensors.base import QuantizedTensor
from qtensor.training.linear import (
    LinearState,
    TrainingLinearFunction,
    WeightHolder,
    compute_dtype,
    needs_backward,
)
from qtensor.training.roles import SRSeeds
from qtensor.training.weight_cache import WeightCache, check_skip_update

_COMPUTE_DTYPES = (torch.bfloat16, torch.float32)


def check_weight(weight: torch.Tensor, label: str = "the layer") -> None:
    """Reject weights MXFP4 QAT cannot train: quantized, fp16, not 2-D, or distributed."""
    if isinstance(weight, QuantizedTensor) or weight.dtype.itemsize == 1:
        raise TypeError(
            f"MXFP4 QAT trains a high-precision master weight; {label} holds {type(weight).__name__} "
            f"of dtype {weight.dtype} (a primary quantized weight). Apply MXFP4QATConfig to the "
            "bf16/fp32 model instead."
        )
    if weight.dtype not in _COMPUTE_DTYPES:
        raise TypeError(
            f"MXFP4 QAT takes bf16 or fp32 master weights; {label} has {weight.dtype}. fp16 "
            "cannot hold the MXFP4 grid (2**-127 .. 6 * 2**125); keep the master weights in "
            "bf16 or fp32."
        )
    if type(weight).__name__ == "DTensor":
        raise NotImplementedError(
            f"MXFP4 QAT of a sharded (DTensor) weight is not supported yet ({label}): shards "
            "would cut its 1x32 and 128x128 blocks. Train this layer unsharded or exclude it "
            "with filter_fn."
        )


class MXFP4QATLinear(nn.Linear):
    """nn.Linear training through MXFP4 QAT; build with quantize_(model, MXFP4QATConfig())."""

    @classmethod
    def from_linear(cls, module: nn.Linear, config) -> "MXFP4QATLinear":
        module.__class__ = cls  # keeps the Parameters an optimizer may already hold
        module.qat_config = config
        # is_first_microbatch=False on an empty cache converts (strict_reuse=False).
        module.weight_cache = WeightCache(strict_reuse=False)
        return module

    @property
    def host(self) -> Host:
        return Host(self.qat_config.host)

    def linear_state(self, backend) -> LinearState:
        """The training linear's state for this config and GEMM backend (built once per pair:
        a recipe switch, or a move to a device with another backend, builds a new one)."""
        key = (self.qat_config, backend)
        if getattr(self, "_state_key", None) != key:
            c = self.qat_config
            native = backend if backend is not GemmBackend.EMULATED else None
            self._state = LinearState(
                hosts.operand_specs(self.host, c.backward_override), SRSeeds(),
                fuse_wgrad_accumulation=c.fuse_wgrad_accumulation,
                bias_in_compute_dtype=False, gemm_backend=native)
            self._state_key = key
        return self._state

    def forward(self, x: torch.Tensor, *, is_first_microbatch: bool | None = None,
                skip_update: torch.Tensor | None = None) -> torch.Tensor:
        """is_first_microbatch (TE semantics): True converts the weight and caches it, False
        reuses the cache (converting if it is empty); None converts when the weight changed.
        skip_update, a 0-d bool tensor on the weight's device, gates the cache rewrite inside a
        CUDA graph: where it is True the replay keeps the first micro-batch's weight bytes."""
        x = self._check_input(x)
        check_weight(self.weight, "this MXFP4QATLinear")
        config = self.qat_config
        if config.fuse_wgrad_accumulation and getattr(self.weight, "main_grad", None) is None:
            raise RuntimeError(
                "fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 buffer of the "
                "weight's shape) to add the weight gradient into; allocate it before training."
            )
        check_skip_update(skip_update, self.weight)
        backend = hosts.gemm_backend(self.host, self.weight.device, config.native_gemm)
        state = self.linear_state(backend)
        w_op = self.weight_cache.get(
            self.weight, lambda w: hosts.weight_operand(w, config, backend), key=(config, backend),
            is_first_microbatch=is_first_microbatch, skip_update=skip_update,
        )
        if self.training and torch.is_grad_enabled() and self.weight.requires_grad:
            self._check_tokens(x)
        backward = needs_backward(x, self.weight, self.bias)
        return TrainingLinearFunction.apply(x, self.weight, self.bias, WeightHolder(w_op), state,
                                            x.dtype, backward, None)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedTensor):
            raise TypeError(
                f"MXFP4QATLinear quantizes its input itself; got a {type(x).__name__}. Pass "
                "the high-precision activation."
            )
        dtype = compute_dtype(x)
        if dtype not in _COMPUTE_DTYPES:
            raise TypeError(
                f"MXFP4QATLinear computes in bf16 or fp32; got {dtype} "
                f"({'autocast' if dtype != x.dtype else 'input'}). fp16 cannot hold the MXFP4 "
                "grid; use bf16 autocast or bf16/fp32 inputs."
            )
        return x.to(dtype)

    def _check_tokens(self, x: torch.Tensor) -> None:
        tokens = x.numel() // x.shape[-1]
        need = hosts.token_multiple(self.host)
        if self.qat_config.backward_override is None and tokens % need:
            raise ValueError(
                f"MXFP4 QAT on host {self.host.value!r} quantizes the wgrad operands along the "
                f"tokens in blocks of {need}; got {tokens} tokens. Pad the batch to a multiple "
                f"of {need}, or use backward_override='high_precision' or 'dequantized'."
            )

    def extra_repr(self) -> str:
        c = self.qat_config
        return (f"{super().extra_repr()}, host={c.host}, direct={c.direct}, "
                f"backward_override={c.backward_override}")
