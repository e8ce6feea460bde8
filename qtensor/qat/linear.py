"""MXFP4QATLinear: an nn.Linear whose GEMMs see its weight's MXFP4 projection in host bytes.

[Note: QAT linear dataflow]
    fprop  Y  = X @ W^T    X host-rowwise            x  weight fwd operand (MXFP4 -> host)
    dgrad  dX = dY @ W     None: dY host-rowwise     x  weight dgrad operand
                           "dequantized": dY         x  dequantize(weight fwd operand) = w^
                           "high_precision": dY      x  the master weight W
    wgrad  dW = dY^T @ X   None: dY host-columnwise  x  X host-columnwise
                           "dequantized": dY^T       x  dequantize(X host-rowwise)
                           "high_precision": dY^T    x  X
The weight dgrad operand is, on the MXFP8 host, a fresh 32x1 MXFP8 quantization of w^; on the
FP8 block host the same 128x128 tiles as fprop (a square tile transposes exactly). dW is the
gradient with respect to w^ handed unchanged to W: the straight-through estimator. High-
precision GEMMs run in the compute dtype (the input's, or autocast's); quantized ones on exact
decoded values (hosts.py). fp16 is rejected: the MXFP4 grid spans 2**-127 .. 6 * 2**125.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from qtensor.ops.gemm_operands import fresh_reshape
from qtensor.qat import hosts
from qtensor.qat.cache import WeightCache, WeightOperands
from qtensor.qat.hosts import Host
from qtensor.tensors.base import QuantizedTensor
from qtensor.training.linear import compute_dtype

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


class _QATLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ops: WeightOperands, module: "MXFP4QATLinear"):
        host, override, backend = module.host, module.qat_config.backward_override, ops.backend
        x2 = x.reshape(-1, x.shape[-1])
        with _no_autocast(x):
            xq = hosts.quantize(x2, host, columnwise=False)
            y = hosts.mm(xq, ops.fwd.t(), x.dtype, backend, bias)
        ctx.plan = (host, override, backend, module.qat_config.fuse_wgrad_accumulation)
        ctx.shapes = (x.shape, x.dtype, bias is not None, weight.dtype)
        if override is None:
            x_col = hosts.quantize(x2, host, columnwise=True) if ctx.needs_input_grad[1] else None
            ctx.operands = (x_col, ops.dgrad)
        elif override == "dequantized":
            ctx.operands = (xq, ops.fwd)
        else:
            ctx.save_for_backward(x2, weight)
        ctx.weight = weight if module.qat_config.fuse_wgrad_accumulation else None
        return fresh_reshape(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, dy):
        host, override, backend, fuse = ctx.plan
        x_shape, x_dtype, has_bias, w_dtype = ctx.shapes
        dy2 = dy.reshape(-1, dy.shape[-1])
        with _no_autocast(dy):
            if override is None:
                x_col, w_dgrad = ctx.operands
                dx = hosts.mm(hosts.quantize(dy2, host, False), w_dgrad, x_dtype, backend)
                dw = None
                if x_col is not None:
                    dy_col = hosts.quantize(dy2, host, True)
                    dw = hosts.mm(dy_col.t(), x_col, torch.float32, backend)
            elif override == "dequantized":
                xq, w_fwd = ctx.operands
                dx = dy2 @ w_fwd.dequantize(dy2.dtype)
                dw = dy2.t() @ xq.dequantize(dy2.dtype)
            else:
                x2, weight = ctx.saved_tensors
                dx = dy2 @ weight.to(dy2.dtype)
                dw = dy2.t() @ x2
        dbias = dy2.float().sum(0) if has_bias else None
        dw = _route_wgrad(ctx, dw, fuse, w_dtype)
        return dx.reshape(x_shape).to(x_dtype), dw, dbias, None, None


def _route_wgrad(ctx, dw, fuse: bool, w_dtype: torch.dtype):
    """STE: dW (with respect to w^) goes to .grad, or is added into weight.main_grad."""
    if dw is None or not ctx.needs_input_grad[1]:
        return None
    if not fuse:
        return dw.to(w_dtype)
    ctx.weight.main_grad.add_(dw.to(ctx.weight.main_grad.dtype))
    return None


def _no_autocast(t: torch.Tensor):
    """Quantized GEMMs multiply exact fp32 values: autocast must not downcast them."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


class MXFP4QATLinear(nn.Linear):
    """nn.Linear training through MXFP4 QAT; build with quantize_(model, MXFP4QATConfig())."""

    @classmethod
    def from_linear(cls, module: nn.Linear, config) -> "MXFP4QATLinear":
        module.__class__ = cls  # keeps the Parameters an optimizer may already hold
        module.qat_config = config
        module.weight_cache = WeightCache()
        return module

    @property
    def host(self) -> Host:
        return Host(self.qat_config.host)

    def forward(self, x: torch.Tensor, *, is_first_microbatch: bool | None = None,
                skip_update: torch.Tensor | None = None) -> torch.Tensor:
        """is_first_microbatch (TE semantics): True converts the weight and caches it, False
        reuses the cache; None converts when the weight changed. skip_update, a 0-d bool
        tensor on the weight's device, gates the cache rewrite inside a CUDA graph: where it is
        True the replay keeps the first micro-batch's weight bytes."""
        x = self._check_input(x)
        check_weight(self.weight, "this MXFP4QATLinear")
        fuse = self.qat_config.fuse_wgrad_accumulation
        if fuse and getattr(self.weight, "main_grad", None) is None:
            raise RuntimeError(
                "fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 buffer of the "
                "weight's shape) to add the weight gradient into; allocate it before training."
            )
        backend = hosts.gemm_backend(self.host, self.weight.device, self.qat_config.native_gemm)
        ops = self.weight_cache.get(self.weight, self.qat_config, backend,
                                    is_first_microbatch, skip_update)
        if self.training and torch.is_grad_enabled() and self.weight.requires_grad:
            self._check_tokens(x)
        return _QATLinearFn.apply(x, self.weight, self.bias, ops, self)

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
