"""The experts' operands of a grouped linear as one operand each, for the grouped GEMM.

A grouped linear quantizes each expert's activation, gradient and weight with that expert's own
per-tensor amax (so expert e is an independent TrainingLinear). The grouped GEMM
(`qtensor.gemm.grouped.grouped_mm`) takes all tokens as one left operand [T, K] and all experts'
weights as one right operand [E, K, N], each with one amax per storage row. Both are the same
bytes rearranged:

- `cat_rows`: the experts' left operands [m_e, K] one after another as [T, K]. An NVFP4 part's
  amax becomes the amax of each of its rows (a row-scaled operand); every row decodes with the
  same A as before, so every product is the same (docs/formats.md, "Variants": row-scaled).
- `ExpertStack`: the experts' weight operands stacked as [E, ...] once per weight rebuild, with
  each expert's operand a view of the stack, so the weight's bytes exist once.

Only the layout changes: codes and scales are copied bit for bit, and the epilogue of a
row-scaled operand multiplies by the row's amax where a per-tensor one multiplies by the
tensor's, the same fp32 product.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.ops import quant
from qtensor.ops.gemm_operands import Side
from qtensor.tensors import HybridTensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor
from qtensor.tensors.common import COLUMNWISE, ROWWISE, bytes_spec

_STACKABLE = (NVFP4Tensor, MXFP8Tensor)


def _part_problem(parts: Sequence[QuantizedTensor]) -> str | None:
    """Why these per-expert operands cannot be put side by side in one operand, or None: they
    must be NVFP4 or MXFP8 tensors of one class, spec, axis, dtype and trailing shape, and NVFP4
    ones untransformed (an RHT operand pairs only with its own transform)."""
    first = parts[0]
    if type(first) not in _STACKABLE:
        return f"a {type(first).__name__} operand (NVFP4 or MXFP8 only)"
    for p in parts:
        if type(p) is not type(first) or (p.spec is not first.spec and p.spec != first.spec) or \
                p.axis != first.axis or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            return f"operands of different layouts ({first!r} and {p!r})"
    if isinstance(first, NVFP4Tensor) and first.rht:
        return "an RHT-transformed NVFP4 operand"
    return None


def _check(parts) -> None:
    if not parts:
        raise ValueError("stacking the experts' operands needs at least one operand.")
    if torch.compiler.is_compiling():
        return  # checked eagerly; traced, the parts are the role's own casts
    problem = _part_problem(parts)
    if problem:
        raise ValueError(f"the experts' operands cannot form one grouped operand: {problem}.")


def _row_scaled(spec):
    # The stacked NVFP4 operand's spec: one amax per storage row. block_2d only said how the
    # parts' scales were chosen (16x16 tiles, stored per row); the bytes are read the same way.
    if spec.row_scaled:
        return spec
    return dataclasses.replace(spec, row_scaled=True, block_2d=False)


def cat_rows(parts: Sequence[QuantizedTensor], spec) -> QuantizedTensor:
    """Rowwise left operands [m_e, K] as one [sum m_e, K] operand (bytes concatenated); `spec`
    is the spec the parts were quantized with (the role's: under torch.compile a spec read off
    a tensor made in the graph cannot be traced)."""
    _check(parts)
    first = parts[0]
    if first.axis != ROWWISE or first.dim() != 2:
        raise ValueError(f"cat_rows takes 2-D rowwise operands; got {first!r}.")
    rows = sum(p.shape[0] for p in parts)
    qdata = torch.cat([p.qdata for p in parts])
    scale = torch.cat([p.scale for p in parts])
    shape = (rows, first.shape[1])
    if isinstance(first, MXFP8Tensor):
        return first.replace(shape=shape, qdata=qdata, scale=scale)
    amax = torch.cat([p.amax.expand(p.shape[0]) if p.amax.dim() == 0 else p.amax for p in parts])
    return first.replace(shape=shape, qdata=qdata, scale=scale, amax=amax,
                         spec=_row_scaled(bytes_spec(spec)))


def _stack(parts: Sequence[QuantizedTensor], spec) -> QuantizedTensor:
    """[E, *part.shape]: the parts' bytes stacked; an NVFP4 part's amax repeated over its storage
    rows (a contiguous [E, R], so the stack can be written in place)."""
    first = parts[0]
    qdata = torch.stack([p.qdata for p in parts])
    scale = torch.stack([p.scale for p in parts])
    shape = (len(parts), *first.shape)
    if isinstance(first, MXFP8Tensor):
        return first.replace(shape=shape, qdata=qdata, scale=scale)
    if any(p.amax.dim() for p in parts):
        amax = torch.stack([p.amax for p in parts])
    else:
        amax = torch.stack([p.amax for p in parts])[:, None].expand(qdata.shape[:-1]).contiguous()
    return first.replace(shape=shape, qdata=qdata, scale=scale, amax=amax,
                         spec=_row_scaled(bytes_spec(spec)))


def _view(stack: QuantizedTensor, e: int, spec, per_tensor: bool) -> QuantizedTensor:
    """Expert e's operand on the stack's bytes, with the spec it was quantized with and, for a
    per-tensor NVFP4 part, its 0-d amax (a view of the stack's, so an in-place rewrite of the
    stack reaches it)."""
    fields = {"qdata": stack.qdata[e], "scale": stack.scale[e], "spec": spec}
    if isinstance(stack, NVFP4Tensor):
        fields["amax"] = stack.amax[e, 0] if per_tensor else stack.amax[e]
    return stack.replace(shape=stack.shape[1:], **fields)


@dataclasses.dataclass
class ExpertStack:
    """A grouped linear's weight operands: `rows` the fprop operand [E, N, K] (rowwise), `cols`
    the dgrad operand [E, N, K] (columnwise; None without that usage), and `op(e)` expert e's
    operand as quantize_weight builds it for that expert alone, made on first use as a view of
    the stacks (only the backward overrides multiply per expert)."""

    rows: QuantizedTensor
    cols: QuantizedTensor | None
    row_spec: object  # each expert's rowwise spec, and columnwise spec (None: rowwise only)
    col_spec: object | None
    per_tensor: tuple[bool, bool]  # whether each usage's parts hold a 0-d amax
    source: str | None  # the HybridTensor's columnwise_source; None: one rowwise operand
    _ops: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def op(self, e: int) -> QuantizedTensor:
        """Expert e's operand (a HybridTensor of both usages, or its rowwise tensor)."""
        out = self._ops.get(e)
        if out is None:
            row = _view(self.rows, e, self.row_spec, self.per_tensor[0])
            if self.source is None:
                out = row
            else:
                col = _view(self.cols, e, self.col_spec, self.per_tensor[1])
                out = HybridTensor(row.shape, row.dtype, row.device, rowwise=row, columnwise=col,
                                   columnwise_source=self.source)
            self._ops[e] = out
        return out

    @classmethod
    def build(cls, ops: Sequence[QuantizedTensor], role) -> "ExpertStack":
        """Stack the experts' weight operands (a HybridTensor or one rowwise tensor each), as
        each expert's quantize_weight made them for `role` (a RoleSpec)."""
        hybrid = isinstance(ops[0], HybridTensor)
        row_parts = [op.rowwise if hybrid else op for op in ops]
        col_parts = [op.columnwise for op in ops] if hybrid else None
        _check(row_parts)
        if col_parts is not None:
            _check(col_parts)
        per_tensor = tuple(isinstance(p[0], NVFP4Tensor) and p[0].amax.dim() == 0
                           for p in (row_parts, col_parts or row_parts))
        row_spec = bytes_spec(role.rowwise)
        col_spec = bytes_spec(role.columnwise) if hybrid else None
        return cls(_stack(row_parts, row_spec),
                   _stack(col_parts, col_spec) if hybrid else None, row_spec, col_spec,
                   per_tensor, role.columnwise_source if hybrid else None)

    def tensors(self) -> list:
        """The stacks, which the weight cache rewrites in place on a gated update (the
        experts' views follow)."""
        return [self.rows] if self.cols is None else [self.rows, self.cols]


# ---- all experts' token rows quantized at once -----------------------------------------------


def rows_problem(spec) -> str | None:
    """Why cast_expert_rows cannot cast every expert's rows for this rowwise spec, or None."""
    if not isinstance(spec, NVFP4Spec) or spec.block_2d or spec.row_scaled or spec.rht or \
            spec.columnwise:
        return "not a 1x16-block NVFP4 rowwise spec with one amax"
    if spec.stochastic_rounding:
        return "stochastic rounding draws each expert's bits from its own seed"
    return None


def _expert_of(offs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The expert owning each token position (offs: int32 cumulative ends)."""
    return torch.searchsorted(offs, positions, right=True)


def expert_amax(x2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[E] fp32: max |x_e| of each expert's rows of x2 [T, C] (0 for an expert without rows).

    An expert's amax is the largest of its rows' amax patterns: the kernels reduce max |x| as an
    integer max of the sign-cleared bit patterns (NaN above inf), so the maximum over rows, taken
    the same way, is the expert's own reduction bit for bit, NaN included.
    """
    t = x2.shape[0]
    row = quant.nvfp4_row_amax(x2)
    expert = _expert_of(offs, torch.arange(t, device=x2.device, dtype=torch.int32))
    bits = torch.zeros(offs.shape[0], dtype=torch.int32, device=x2.device)
    return bits.scatter_reduce_(0, expert, row.view(torch.int32), "amax").view(torch.float32)


def cast_expert_rows(x2: torch.Tensor, splits: Sequence[int], offs: torch.Tensor, spec,
                     amax: torch.Tensor | None = None, parts: bool = True):
    """(all rows, each expert's rows): x2 [T, C] (experts' tokens one after another, `offs` their
    int32 cumulative ends on x2's device) quantized rowwise with each expert's own amax in one
    pass (`amax`: expert_amax(x2, offs) when already known). The first is the grouped GEMM's
    left operand (row-scaled); the second holds, for each expert with tokens, bitwise the tensor
    the expert's own quantize_rowwise gives (its rows of the first, with its 0-d amax and
    `spec`), None for the others; None itself without `parts`.
    """
    t = x2.shape[0]
    amax = expert_amax(x2, offs) if amax is None else amax
    expert = _expert_of(offs, torch.arange(t, device=x2.device, dtype=torch.int32))
    whole = _nvfp4_rows(x2, spec, amax[expert])
    if not parts:
        return whole, None
    out, start, stored = [], 0, bytes_spec(spec)
    for e, m in enumerate(splits):
        out.append(None if m == 0 else whole.replace(
            shape=(m, x2.shape[1]), qdata=whole.qdata[start:start + m],
            scale=whole.scale[start:start + m], amax=amax[e], spec=stored))
        start += m
    return whole, out


# ---- all experts' token columns quantized at once ----------------------------------------------


def cols_problem(spec) -> str | None:
    """Why cast_expert_cols cannot cast every expert's columns for this spec, or None."""
    if not isinstance(spec, NVFP4Spec) or not spec.columnwise or spec.block_2d or spec.rht or \
            spec.fourover6:
        return "not a columnwise NVFP4 spec without 2D blocks, RHT or 4over6"
    if spec.stochastic_rounding:
        return "stochastic rounding draws each expert's bits from its own seed"
    return None


_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
         torch.float32: (torch.int32, 0x7FFFFFFF)}
CAST_DTYPES = tuple(_BITS)  # the dtypes cast_expert_cols takes


def _expert_col_amax(x2: torch.Tensor, experts: int, blocks: torch.Tensor) -> torch.Tensor:
    """[E, C] fp32: max |x| of each column over each expert's tokens (blocks: the expert of each
    16-token run), reduced as the kernels reduce a row-scaled columnwise amax: an integer max of
    the sign-cleared bit patterns (NaN above inf), then the input's value in fp32."""
    t, c = x2.shape
    kind, mask = _BITS[x2.dtype]
    runs = (x2.view(kind) & mask).view(t // 16, 16, c).amax(1).to(torch.int32)
    bits = torch.zeros(experts, c, dtype=torch.int32, device=x2.device).scatter_reduce_(
        0, blocks[:, None].expand(-1, c), runs, "amax")
    if x2.dtype == torch.float32:
        return bits.view(torch.float32)
    return bits.to(kind).view(x2.dtype).float()


def cast_expert_cols(x2: torch.Tensor, offs: torch.Tensor, spec,
                     amax: torch.Tensor | None = None) -> Side:
    """x2 [T, C] (experts' tokens one after another) quantized columnwise, blocks of 16 tokens,
    with each expert's own amax in one pass, as the product grouped along K takes it
    (qtensor/ops/gemm_k.py): codes [C, T/2], scales [C, T/16] and the experts' amaxes, [E], or
    [E, C] for a row-scaled spec (each expert's max |x_e| per column).

    Expert e's columns are bitwise its own columnwise cast: each expert's token count is a
    multiple of 16, so every block holds one expert's tokens and is quantized with that
    expert's amax (a per-block amax, docs/formats.md's step 1 per block). `amax`: the experts'
    [E] amax when known (without RHT a tensor's two usages share it).
    """
    t, c = x2.shape
    blocks = _expert_of(offs, torch.arange(0, t, 16, device=x2.device, dtype=torch.int32))
    if spec.row_scaled:
        amax = _expert_col_amax(x2, offs.shape[0], blocks)
        per_block = amax[blocks].t()
    else:
        amax = expert_amax(x2, offs) if amax is None else amax
        per_block = amax[blocks][None, :].expand(c, -1)
    plain = dataclasses.replace(spec, row_scaled=False)
    data, _ = quant.quantize_nvfp4(x2, plain, global_amax=per_block.contiguous())
    return Side(data.qdata, data.scale, amax, spec.e4m3_bound)


# ---- all experts' weights quantized at once ------------------------------------------------------


def _at_once_problem(role) -> str | None:
    """Why quantize_experts cannot quantize this weight role for all experts at once, or None."""
    row, col = role.rowwise, role.columnwise
    if not isinstance(row, NVFP4Spec) or row.block_2d or row.row_scaled or row.rht or \
            row.stochastic_rounding:
        return "the weight's rowwise usage is not 1x16-block NVFP4 with one amax"
    if col is None:
        return None
    if isinstance(col, NVFP4Spec) and role.columnwise_source == "original" and not (
            col.block_2d or col.row_scaled or col.rht or col.stochastic_rounding):
        return None
    if isinstance(col, MXFP8Spec) and role.columnwise_source == "rowwise_dequantized":
        return None
    return "the weight's columnwise usage is neither 1x16-block NVFP4 nor decoded-rowwise MXFP8"


def _nvfp4_rows(x2: torch.Tensor, spec: NVFP4Spec, amax_rows: torch.Tensor) -> NVFP4Tensor:
    """x2 [R, C] quantized rowwise with the given amax per row (row-scaled bytes)."""
    spec = dataclasses.replace(spec, columnwise=False, row_scaled=True)
    return NVFP4Tensor.from_spec(x2, spec, check_finite=False, global_amax=amax_rows)


def quantize_experts(w: torch.Tensor, role) -> ExpertStack | None:
    """The weight operands of E experts w [E, N, K] (a RoleSpec's two usages) from one pass per
    usage, bitwise what quantizing each expert's [N, K] for the role gives; None where the role
    is not one this takes (_at_once_problem: 2-D blocks, whose tiles take per-tensor scales).

    Each expert's NVFP4 amax is max |w_e|, the maximum of its rows' maxima (a max is exact,
    so the same value as the expert's own reduction), given to the quantizer once per storage
    row: the row-scaled quantization of that row with that amax is the per-tensor one. The
    columnwise usage is the rowwise quantization of each expert's transpose, which is how
    docs/formats.md defines it; the MXFP8 one (dgrad_mxfp8) blocks 32 rows of [E * N, K],
    never across two experts as N is a multiple of 32.
    """
    if _at_once_problem(role) is not None:
        return None
    e, n, k = w.shape
    row_amax = quant.nvfp4_row_amax(w.reshape(e * n, k)).view(e, n).amax(1)
    rows = _nvfp4_rows(w.reshape(e * n, k), role.rowwise, row_amax.repeat_interleave(n))
    rows = rows.replace(shape=(e, n, k), qdata=rows.qdata.view(e, n, -1),
                        scale=rows.scale.view(e, n, -1), amax=rows.amax.view(e, n))
    col, cols = role.columnwise, None
    if isinstance(col, NVFP4Spec):
        t = _nvfp4_rows(w.transpose(1, 2).reshape(e * k, n), col, row_amax.repeat_interleave(k))
        cols = t.replace(shape=(e, n, k), qdata=t.qdata.view(e, k, -1),
                         scale=t.scale.view(e, k, -1), amax=t.amax.view(e, k), axis=COLUMNWISE,
                         spec=dataclasses.replace(col, row_scaled=True))
    elif col is not None:
        decoded = rows.replace(shape=(e * n, k), qdata=rows.qdata.view(e * n, -1),
                               scale=rows.scale.view(e * n, -1),
                               amax=rows.amax.view(-1)).dequantize(w.dtype)
        m = MXFP8Tensor.from_spec(decoded, col, check_finite=False)
        cols = m.replace(shape=(e, n, k), qdata=m.qdata.view(e, n, k),
                         scale=m.scale.view(e, n // 32, k))
    return ExpertStack(rows, cols, role.rowwise, col, (True, isinstance(col, NVFP4Spec)),
                       None if col is None else role.columnwise_source)
