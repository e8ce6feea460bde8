"""Grouped linear for MoE experts: stacked expert weights, tokens sorted by expert.

`GroupedLinear(E, K, N)(x [T, K], tokens_per_expert)` computes, for the contiguous rows of x
that belong to expert e, `x_e @ W[e]^T + b[e]`, forward and backward with the same recipe and
the same role pieces as TrainingLinear: expert e's operands are bitwise a TrainingLinear's
holding W[e], and so is every output and gradient on the CPU (tests/test_training_grouped.py).
Experts with zero tokens take no product and get an exactly zero weight and bias gradient.

fprop and dgrad are one grouped GEMM each for all experts, on the experts' operands put side by
side (qtensor/training/experts.py: the weights stacked once per rebuild, the input and gradient
rows concatenated); on the GPU the grouped kernel's fp32 sums run in their own order, so the
output and dX equal the per-expert products up to that order. wgrad reduces over each expert's
own tokens: one product grouped along the tokens for all experts ([Note: grouped along K] in
qtensor/ops/gemm_k.py), bitwise each expert's own product on the CPU and equal to it up to the
fp32 summation order on the GPU.

The input's and gradient's casts run once for all experts where nothing but the amax depends
on the expert (`whole_casts`; experts.py): the rowwise usages with a per-token amax or each
row its expert's, the columnwise usages with a per-block amax, each 16-token block its
expert's. Each expert's bytes are then its own cast's, produced in one pass. RHT and
stochastically rounded columnwise usages (the amax after the transform, each expert's seed)
and 4over6 ones are still cast per expert, as Transformer Engine's GroupedLinear casts every
expert, and their bytes put side by side for the grouped products.

Every NVFP4 columnwise operand blocks along tokens, so each expert's token count must be a
multiple of 16 (32 with MXFP8 columnwise usages) for a quantized backward: pad per expert.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from qtensor.gemm.grouped import expert_offsets, grouped_mm, grouped_mm_k, grouped_mm_k_sides
from qtensor.ops.gemm_operands import NVFP4, Side
from qtensor.training.experts import (
    CAST_DTYPES,
    ExpertStack,
    cast_expert_cols,
    cast_expert_rows,
    cat_rows,
    cols_problem,
    expert_amax,
    quantize_experts,
    rows_problem,
)
from qtensor.training.linear import (
    LinearState,
    WeightHolder,
    backward_gemms,
    compute_dtype,
    forward_input,
    init_sr_state,
    needs_backward,
    quantize_grad_output,
    quantize_weight,
    saved_for_backward,
    shape_error,
    take_sr_state,
)
from qtensor.training.recipe import NVFP4TrainingRecipe
from qtensor.training.roles import SRSeeds, each_call, quantize_rowwise
from qtensor.training.weight_cache import WeightCache


def _bounds(splits: Sequence[int]):
    start = 0
    for m in splits:
        yield start, m
        start += m


def shared_input_rowwise(x2: torch.Tensor, state: LinearState):
    """The input's rowwise operand for all tokens at once when it is row-scaled, else None."""
    spec = state.specs.input.rowwise
    if x2.shape[0] == 0 or not getattr(spec, "row_scaled", False):
        return None
    return quantize_rowwise(x2, state.specs.input, "input")


def whole_casts(state: LinearState, splits: Sequence[int], dtype) -> bool:
    """Whether the input's and the gradient's casts run for all experts at once: a quantized
    backward whose input and gradient usages cast_expert_rows / cast_expert_cols take (the
    input's rowwise may be row-scaled), every expert's token count a multiple of 16."""
    specs = state.specs
    x_role, g_role = specs.input, specs.grad_output
    if specs.backward_override is not None or x_role.columnwise is None or \
            g_role.columnwise is None or dtype not in CAST_DTYPES or \
            not all(m % 16 == 0 for m in splits):
        return False
    x_row = x_role.rowwise
    return (getattr(x_row, "row_scaled", False) or rows_problem(x_row) is None) and \
        rows_problem(g_role.rowwise) is None and cols_problem(x_role.columnwise) is None and \
        cols_problem(g_role.columnwise) is None


class GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_holder: WeightHolder, state: LinearState, splits, dtype,
                backward, sr):
        override = state.specs.backward_override
        stack: ExpertStack = w_holder.op
        ctx.whole = stack.cols is not None and x.shape[0] > 0 and whole_casts(state, splits, dtype)
        if ctx.whole:
            return _whole_forward(ctx, x, weight, bias, stack, state, splits, dtype,
                                  backward and ctx.needs_input_grad[1])
        # dgrad multiplies the stacked columnwise weight when the backward is quantized; the
        # overrides multiply each expert's saved operands (or its high-precision weight).
        grouped_dgrad = override is None and stack.cols is not None
        per_expert_w = not grouped_dgrad and override != "high_precision"
        x_saved, w_saved, rows = [], [], []
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.to(dtype)
            offs = expert_offsets(splits, x.device) if x2.shape[0] else None
            shared, parts = shared_input_rowwise(x2, state), None
            if shared is None and offs is not None and \
                    rows_problem(state.specs.input.rowwise) is None:
                shared, parts = cast_expert_rows(x2, splits, offs, state.specs.input.rowwise)
            calls = each_call(sr, len(splits))
            for e, (start, m) in enumerate(_bounds(splits)):
                if m == 0:
                    x_saved.append(None)
                    w_saved.append(None)
                    continue
                x_e = x2[start:start + m]
                row = parts[e] if parts is not None else (
                    shared[start:start + m] if shared is not None else None)
                # Expert e rounds with seed + e: the step advanced the state by E seeds.
                x_op = forward_input(x_e, state, backward, rowwise=row,
                                     sr=None if calls is None else calls[e])
                rows.append(x_op.gemm_operand("left"))
                xs, ws = saved_for_backward(x_e, x_op, weight[e],
                                            stack.op(e) if per_expert_w else None, override)
                x_saved.append(xs)
                w_saved.append(ws)
            if rows:
                # One grouped product for every expert: an input quantized once is already the
                # experts' rows one after another.
                left = shared if shared is not None else cat_rows(rows,
                                                                  state.specs.input.rowwise)
                b = bias.to(dtype) if bias is not None else None
                y = grouped_mm(left, stack.rows.transpose(-1, -2), offs, b, dtype)
        ctx.save_for_backward(*x_saved, *w_saved, sr, offs,
                              stack.cols if grouped_dgrad else None)
        _meta(ctx, state, splits, dtype, x, weight, bias)
        if not rows:
            return x2.new_zeros(0, weight.shape[1])
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.whole:
            return _whole_backward(ctx, dy)
        saved = ctx.saved_tensors
        n_exp = len(ctx.splits)
        x_saved, w_saved = saved[:n_exp], saved[n_exp:2 * n_exp]
        sr, offs, w_cols = saved[2 * n_exp:]
        (w_shape, w_dtype), dtype = ctx.w_meta, ctx.dtype
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        dxs, rows, dy_ops = [], [], [None] * n_exp
        # The overrides fill dW expert by expert; the quantized backward's grouped wgrad makes
        # all of it (zeros for experts without tokens) in one product.
        dw = torch.zeros(w_shape, dtype=w_dtype, device=dy.device) \
            if need[1] and w_cols is None else None
        state = ctx.state
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.to(dtype)
            calls = each_call(sr, n_exp)
            dy_rows, dy_parts = None, None
            row_spec = state.specs.grad_output.rowwise
            if w_cols is not None and offs is not None and rows_problem(row_spec) is None:
                dy_rows, dy_parts = cast_expert_rows(dy2, ctx.splits, offs, row_spec)
            for e, (start, m) in enumerate(_bounds(ctx.splits)):
                if m == 0:
                    continue
                dy_e, sr_e = dy2[start:start + m], None if calls is None else calls[e]
                if w_cols is None:
                    dx_e, dw_e = backward_gemms(dy_e, x_saved[e], w_saved[e], state, dtype,
                                                w_dtype, need, sr_e)
                    dxs.append(dx_e)
                else:
                    dy_op = quantize_grad_output(dy_e, state, sr_e,
                                                 None if dy_parts is None else dy_parts[e])
                    rows.append(dy_op.gemm_operand("left"))
                    dy_ops[e] = dy_op
                    dw_e = None
                if dw is not None and dw_e is not None:
                    dw[e] = dw_e
            if need[1] and w_cols is not None:
                # Every expert's wgrad in one product grouped along the tokens.
                dw = grouped_mm_k(dy_ops, x_saved, w_dtype) if rows else \
                    torch.zeros(w_shape, dtype=w_dtype, device=dy.device)
            db = _bias_grad(ctx, dy2)
            dx = None
            if need[0]:
                k = w_shape[-1]
                if rows:
                    if dy_rows is None:
                        dy_rows = cat_rows(rows, row_spec)
                    dx = grouped_mm(dy_rows, w_cols, offs, None, dtype)
                elif dxs:
                    dx = torch.cat(dxs)
                else:
                    dx = dy2.new_zeros(0, k)
                dx = dx.to(ctx.x_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _meta(ctx, state, splits, dtype, x, weight, bias) -> None:
    ctx.state, ctx.splits, ctx.dtype, ctx.x_dtype = state, splits, dtype, x.dtype
    ctx.w_meta = (weight.shape, weight.dtype)
    ctx.b_dtype = bias.dtype if bias is not None else None


def _whole_forward(ctx, x, weight, bias, stack: ExpertStack, state: LinearState, splits, dtype,
                   want_cols: bool):
    """The forward with every expert's input cast at once: the rowwise usage (row-scaled, or
    cast_expert_rows) for the grouped fprop, the columnwise one (cast_expert_cols) saved whole
    for the grouped wgrad."""
    specs = state.specs
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.to(dtype)
        offs = expert_offsets(splits, x.device)
        left, amax = shared_input_rowwise(x2, state), None
        if left is None:
            amax = expert_amax(x2, offs)
            left, _ = cast_expert_rows(x2, splits, offs, specs.input.rowwise, amax, parts=False)
        cols = None
        if want_cols:
            col_spec = specs.input.columnwise
            cols = cast_expert_cols(x2, offs, col_spec, None if col_spec.row_scaled else amax)
        b = bias.to(dtype) if bias is not None else None
        y = grouped_mm(left, stack.rows.transpose(-1, -2), offs, b, dtype)
    ctx.save_for_backward(*((cols.data, cols.scale, cols.amax) if cols else (None,) * 3), offs,
                          stack.cols)
    ctx.x_bound = None if cols is None else cols.bound
    _meta(ctx, state, splits, dtype, x, weight, bias)
    return y


def _bias_grad(ctx, dy2):
    if ctx.b_dtype is None or not ctx.needs_input_grad[2]:
        return None
    db = torch.stack([dy2[s:s + m].float().sum(0) for s, m in _bounds(ctx.splits)])
    return db.to(ctx.b_dtype)


def _whole_backward(ctx, dy):
    """dgrad and wgrad as one grouped product each, the gradient cast for all experts at once
    (its rowwise usage with each expert's amax, then its columnwise one with the same amax: no
    RHT, so both usages of a tensor share it)."""
    x_data, x_scale, x_amax, offs, w_cols = ctx.saved_tensors
    specs, splits, dtype = ctx.state.specs, ctx.splits, ctx.dtype
    dx = dw = None
    with torch.autocast(dy.device.type, enabled=False):
        dy2 = dy.to(dtype)
        amax = expert_amax(dy2, offs)
        if ctx.needs_input_grad[0]:
            rows, _ = cast_expert_rows(dy2, splits, offs, specs.grad_output.rowwise, amax,
                                       parts=False)
            dx = grouped_mm(rows, w_cols, offs, None, dtype).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            cols = cast_expert_cols(dy2, offs, specs.grad_output.columnwise, amax)
            x_cols = Side(x_data, x_scale, x_amax, ctx.x_bound)
            dw = grouped_mm_k_sides(NVFP4, cols, x_cols, offs, ctx.w_meta[1], w_cols)
        db = _bias_grad(ctx, dy2)
    return dx, dw, db, None, None, None, None, None, None


class GroupedLinear(nn.Module):
    """E expert linears [E, out, in] applied to token groups; recipe as in TrainingLinear."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 *, recipe: NVFP4TrainingRecipe | None = None, seed_index: int = 0,
                 device=None, dtype=None):
        super().__init__()
        recipe = recipe or NVFP4TrainingRecipe()
        why = shape_error(in_features, out_features, recipe)
        if why:
            raise ValueError(f"{why}. Pad the expert's features.")
        if num_experts < 1:
            raise ValueError(f"num_experts must be at least 1; got {num_experts}.")
        self.num_experts = num_experts
        self.in_features, self.out_features = in_features, out_features
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **kw)) if bias else None
        self.reset_parameters()
        self._setup(recipe, seed_index)

    def _setup(self, recipe: NVFP4TrainingRecipe, seed_index: int) -> None:
        self.recipe = recipe
        self.state = LinearState(recipe.operand_specs(), SRSeeds(recipe.seed, seed_index))
        init_sr_state(self, self.state.seeds, self.weight.device)
        self.weight_cache = WeightCache()
        self.skip_weight_update: torch.Tensor | None = None

    def with_recipe(self, recipe: NVFP4TrainingRecipe, seed_index: int = 0) -> "GroupedLinear":
        """A GroupedLinear sharing this one's Parameters, training with another recipe."""
        why = shape_error(self.in_features, self.out_features, recipe)
        if why:
            raise ValueError(f"{why}. Pad the expert's features.")
        new = GroupedLinear.__new__(GroupedLinear)
        nn.Module.__init__(new)
        new.num_experts, new.in_features = self.num_experts, self.in_features
        new.out_features, new.weight, new.bias = self.out_features, self.weight, self.bias
        new._setup(recipe, seed_index)
        return new

    def reset_sr_state(self) -> None:
        """Rewind stochastic rounding to its initial state, as TrainingLinear.reset_sr_state."""
        with torch.no_grad():
            self.sr_state.copy_(self.state.seeds.initial_state(self.sr_state.device))

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, per expert: U(-1/sqrt(in), 1/sqrt(in)) for both.
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def _build_weight(self, w: torch.Tensor) -> ExpertStack:
        stack = quantize_experts(w, self.state.specs.weight)
        if stack is not None:
            return stack
        return ExpertStack.build([quantize_weight(w[e], self.state.specs)
                                  for e in range(self.num_experts)], self.state.specs.weight)

    def forward(self, x: torch.Tensor, tokens_per_expert, is_first_microbatch=None):
        """x [T, in] sorted by expert; tokens_per_expert: E ints (a tensor costs a host sync)."""
        splits = self._splits(x, tokens_per_expert)
        w_ops = self.weight_cache.get(
            self.weight, self._build_weight,
            is_first_microbatch=is_first_microbatch, skip_update=self.skip_weight_update,
        )
        backward = needs_backward(x, self.weight, self.bias)
        sr = take_sr_state(self, x, calls=self.num_experts) if backward else None
        return GroupedLinearFunction.apply(
            x, self.weight, self.bias, WeightHolder(w_ops), self.state, splits, compute_dtype(x),
            backward, sr,
        )

    def _splits(self, x: torch.Tensor, tokens_per_expert) -> tuple[int, ...]:
        if isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = tokens_per_expert.tolist()
        splits = tuple(int(m) for m in tokens_per_expert)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GroupedLinear takes x [tokens, {self.in_features}]; got {tuple(x.shape)}."
            )
        if len(splits) != self.num_experts or min(splits) < 0 or sum(splits) != x.shape[0]:
            raise ValueError(
                f"tokens_per_expert needs {self.num_experts} non-negative counts summing to "
                f"{x.shape[0]} tokens; got {list(splits)}."
            )
        return splits

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe}")
