"""The autograd linear of the training stack, and the nn.Linear of the NVFP4 recipe that uses it.

It is the one autograd linear of the package: MXFP4 QAT (qtensor/qat/linear.py) runs it with its
hosts' operand specs and its own weight operand, asking the state for what the NVFP4 recipe does
not use (dW into main_grad, the bias as stored, the native GEMM backend on every operand).

Forward: Y = fprop(input, weight). Backward, by the recipe's backward_override:
- None: quantize grad_output for its role, dX = dgrad(dY, W), dW = wgrad(dY, X) on the
  operands the recipe prescribes (qtensor/training/roles.py);
- "dequantized": both GEMMs in the compute dtype on the forward operands decoded;
- "high_precision": both GEMMs in the compute dtype on the original input and weight.

The compute dtype is the autocast dtype when autocast is on, else the input's dtype; the
output and dX come back in it (dX in the input's dtype), dW in the weight's (master) dtype,
straight from the fp32 accumulator. Autocast is switched off inside, so the emulated GEMMs keep
their fp32 products exact.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qtensor.backends import GemmBackend
from qtensor.ops.gemm_operands import fresh_reshape
from qtensor.tensors import QuantizedTensor
from qtensor.tensors.layout import map_parts
from qtensor.training.recipe import NVFP4TrainingRecipe
from qtensor.training.roles import (
    OperandSpecs,
    SRSeeds,
    advance,
    dgrad,
    fprop,
    quantize_role,
    quantize_rowwise,
    sr_for_role,
    uses_stochastic_rounding,
    wgrad,
)
from qtensor.training.weight_cache import WeightCache


@dataclasses.dataclass
class LinearState:
    """What the autograd function needs besides tensors: the specs and the rounding seeds, and
    what a module may ask of the backward beyond the recipe (MXFP4 QAT asks all three)."""

    specs: OperandSpecs
    seeds: SRSeeds
    # Add dW into `weight.main_grad` (its dtype, Megatron-style) instead of returning it.
    fuse_wgrad_accumulation: bool = False
    # The bias enters the fp32 epilogue rounded to the compute dtype (the training recipe), or
    # as it is stored (MXFP4 QAT: an fp32 bias under bf16 autocast stays exact).
    bias_in_compute_dtype: bool = True
    # The GEMM backend the activation and gradient operands multiply on; None: each tensor's
    # own (chosen when it is made). The weight's operand carries its own.
    gemm_backend: GemmBackend | None = None
    # Whether any slot rounds stochastically: fixed by the specs, so decided once, not per call.
    stochastic: bool = dataclasses.field(init=False)

    def __post_init__(self):
        self.stochastic = uses_stochastic_rounding(self.specs)


@dataclasses.dataclass
class WeightHolder:
    # Holds a quantized weight so autograd's apply() does not treat it as an input.
    op: QuantizedTensor


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device, else x's dtype."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def quantize_weight(weight: torch.Tensor, specs: OperandSpecs) -> QuantizedTensor:
    """The weight's operand (both usages unless the backward is overridden)."""
    return quantize_role(weight, specs.weight, "weight")


def forward_input(x2: torch.Tensor, state: LinearState, backward: bool, rowwise=None, sr=None):
    """The input's operand, 2-D [M, K] in the compute dtype; rowwise only without a backward.
    `sr`: this step's stochastic-rounding rows (take_sr_state), None without stochastic rounding."""
    specs = state.specs
    if not backward:
        op = rowwise if rowwise is not None else quantize_rowwise(x2, specs.input, "input")
    else:
        op = quantize_role(x2, specs.input, "input", sr_for_role("input", specs.input, sr),
                           rowwise=rowwise)
    return on_backend(op, state)


def on_backend(op, state: LinearState):
    """op with its products on the state's GEMM backend (op itself when that is None)."""
    if state.gemm_backend is None:
        return op
    return map_parts(op, lambda part: part.replace(gemm_backend=state.gemm_backend.value))


def needs_backward(*tensors) -> bool:
    """Whether autograd will call the backward (else the wgrad operands are not built)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def saved_for_backward(x2, x_op, weight, w_op, override):
    """(input, weight) the backward needs: originals for high_precision, else the operands."""
    return (x2, weight) if override == "high_precision" else (x_op, w_op)


def backward_gemms(dy2, x_saved, w_saved, state: LinearState, dtype, w_dtype, need, sr=None):
    """(dX [M, K] in dtype, dW [N, K] in w_dtype) from dY [M, N]; None where not needed."""
    override = state.specs.backward_override
    if override is None:
        return quantized_backward(dy2, x_saved, w_saved, state, dtype, w_dtype, need, sr)
    if override == "high_precision":
        x_hp, w_hp = x_saved.to(dtype), w_saved.to(dtype)
    else:
        x_hp, w_hp = x_saved.dequantize(dtype), w_saved.dequantize(dtype)
    return high_precision_backward(dy2, x_hp, w_hp, w_dtype, need)


def quantize_grad_output(dy2, state: LinearState, sr=None, rowwise=None):
    """grad_output [M, N] quantized for its role (both usages), on the state's GEMM backend;
    `rowwise`: its rowwise side cast earlier (quantize_role's)."""
    dy_sr = sr_for_role("grad_output", state.specs.grad_output, sr)
    return on_backend(quantize_role(dy2, state.specs.grad_output, "grad_output", dy_sr,
                                    rowwise=rowwise), state)


def quantized_backward(dy2, x_op, w_op, state: LinearState, dtype, w_dtype, need, sr=None):
    """grad_output quantized for its role, then dgrad and wgrad on the recipe's operands."""
    dy_op = quantize_grad_output(dy2, state, sr)
    dx = dgrad(dy_op, w_op, dtype) if need[0] else None
    dw = wgrad(dy_op, x_op, w_dtype) if need[1] else None
    return dx, dw


def high_precision_backward(dy2, x_hp, w_hp, w_dtype, need):
    """dgrad and wgrad as plain GEMMs in the compute dtype (the overrides)."""
    dx = dy2 @ w_hp if need[0] else None
    dw = (dy2.t() @ x_hp).to(w_dtype) if need[1] else None
    return dx, dw


class TrainingLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_holder: WeightHolder, state: LinearState, dtype, backward,
                sr):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            # The input's columnwise usage feeds only wgrad: built when dW will be computed.
            x_op = forward_input(x2, state, backward and ctx.needs_input_grad[1], sr=sr)
            b = bias.to(dtype) if bias is not None and state.bias_in_compute_dtype else bias
            y = fprop(x_op, w_holder.op, b, dtype)
        override = state.specs.backward_override
        ctx.save_for_backward(*saved_for_backward(x2, x_op, weight, w_holder.op, override), sr)
        ctx.state, ctx.dtype, ctx.x_meta = state, dtype, (x.shape, x.dtype)
        ctx.w_dtype = weight.dtype
        ctx.weight = weight if state.fuse_wgrad_accumulation else None
        ctx.b_dtype = bias.dtype if bias is not None else None
        return fresh_reshape(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, dy):
        x_saved, w_saved, sr = ctx.saved_tensors
        x_shape, x_dtype = ctx.x_meta
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        # STE for QAT: dW, the gradient with respect to the weight's operand, goes to the
        # master weight unchanged (returned, or added into main_grad in its dtype).
        fused = ctx.weight is not None
        w_dtype = ctx.weight.main_grad.dtype if fused else ctx.w_dtype
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(ctx.dtype)
            dx, dw = backward_gemms(dy2, x_saved, w_saved, ctx.state, ctx.dtype, w_dtype,
                                    need, sr)
            if fused and dw is not None:
                ctx.weight.main_grad.add_(dw)
                dw = None
            db = None
            if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(ctx.b_dtype)
        if dx is not None:
            dx = dx.reshape(x_shape).to(x_dtype)
        return dx, dw, db, None, None, None, None, None


def init_sr_state(module: nn.Module, seeds: SRSeeds, device) -> None:
    """Register the module's stochastic-rounding state: a non-persistent int64 buffer [slots, 2]
    that moves with the module (`.to`, FSDP2) and that forwards advance in place."""
    module.register_buffer("sr_state", seeds.initial_state(device), persistent=False)


def take_sr_state(module: nn.Module, x: torch.Tensor, calls: int = 1) -> torch.Tensor | None:
    """This step's stochastic-rounding rows (None when no slot rounds stochastically); the
    module's buffer moves on in place, so a compiled step reads and advances it on the device."""
    if not module.state.stochastic:
        return None
    if module.sr_state.device != x.device:
        raise ValueError(
            f"The stochastic-rounding state is on {module.sr_state.device} but the input is on "
            f"{x.device}: move the module with .to({str(x.device)!r}) (it moves the buffer)."
        )
    return advance(module.sr_state, calls)


class TrainingLinear(nn.Linear):
    """nn.Linear whose GEMMs follow an NVFP4TrainingRecipe; the weight stays high precision.

    `forward(x, is_first_microbatch=None)` reuses the quantized weight as [Note: weight cache]
    describes; set `skip_weight_update` to a bool tensor for the graph-safe mode.
    """

    def __init__(self, in_features, out_features, bias=True, *, recipe=None, seed_index=0,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe or NVFP4TrainingRecipe(), seed_index)

    def _setup(self, recipe: NVFP4TrainingRecipe, seed_index: int) -> None:
        why = shape_error(self.in_features, self.out_features, recipe)
        if why:
            raise ValueError(f"{why}. Exclude this layer (filter_fn) or pad its features.")
        if isinstance(self.weight, QuantizedTensor):
            raise TypeError(
                f"TrainingLinear trains a high-precision master weight; got {self.weight!r}. "
                "Apply the training config to the unquantized model."
            )
        self.recipe = recipe
        self.state = LinearState(recipe.operand_specs(), SRSeeds(recipe.seed, seed_index))
        init_sr_state(self, self.state.seeds, self.weight.device)
        self.weight_cache = WeightCache()
        self.skip_weight_update: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if "sr_state" in self._buffers:  # nn.Linear.__init__ calls this before _setup
            self.reset_sr_state()

    def reset_sr_state(self) -> None:
        """Rewind stochastic rounding to its initial state (e.g. after to_empty from meta)."""
        with torch.no_grad():
            self.sr_state.copy_(self.state.seeds.initial_state(self.sr_state.device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: NVFP4TrainingRecipe, seed_index: int = 0):
        """A TrainingLinear sharing linear's Parameters (optimizer state stays valid)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._setup(recipe, seed_index)
        return new

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        if isinstance(self.weight, QuantizedTensor):
            # FSDP2 gathered the weight already quantized for its role (quantize-before-all-
            # gather, qtensor/distributed/master.py): the operand is the parameter itself.
            w_op = self.weight
        else:
            w_op = self.weight_cache.get(
                self.weight, lambda w: quantize_weight(w, self.state.specs),
                is_first_microbatch=is_first_microbatch, skip_update=self.skip_weight_update,
            )
        backward = needs_backward(x, self.weight, self.bias)
        sr = take_sr_state(self, x) if backward else None
        return TrainingLinearFunction.apply(
            x, self.weight, self.bias, WeightHolder(w_op), self.state, compute_dtype(x), backward,
            sr
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def shape_error(in_features: int, out_features: int, recipe: NVFP4TrainingRecipe) -> str | None:
    """Why a layer of this shape cannot train with the recipe, or None."""
    if in_features % 16:
        return f"NVFP4 needs in_features divisible by 16; got {in_features}"
    quantized_bwd = recipe.backward_override is None
    if (recipe.weight_2d or quantized_bwd) and out_features % 16:
        return f"NVFP4 weights need out_features divisible by 16 here; got {out_features}"
    if recipe.dgrad_mxfp8 and out_features % 32:
        return f"dgrad_mxfp8 needs out_features divisible by 32 (MXFP8 blocks); got {out_features}"
    return None
