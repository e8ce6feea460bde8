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

from qtensor.tensors import HybridTensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor
from qtensor.tensors.common import ROWWISE

_STACKABLE = (NVFP4Tensor, MXFP8Tensor)


def part_problem(parts: Sequence[QuantizedTensor]) -> str | None:
    """Why these per-expert operands cannot be put side by side in one operand, or None: they
    must be NVFP4 or MXFP8 tensors of one class, spec, axis, dtype and trailing shape, and NVFP4
    ones untransformed (an RHT operand pairs only with its own transform)."""
    first = parts[0]
    if type(first) not in _STACKABLE:
        return f"a {type(first).__name__} operand (NVFP4 or MXFP8 only)"
    for p in parts:
        if type(p) is not type(first) or p.spec != first.spec or p.axis != first.axis or \
                p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            return f"operands of different layouts ({first!r} and {p!r})"
    if isinstance(first, NVFP4Tensor) and first.rht:
        return "an RHT-transformed NVFP4 operand"
    return None


def _check(parts) -> None:
    if not parts:
        raise ValueError("stacking the experts' operands needs at least one operand.")
    problem = part_problem(parts)
    if problem:
        raise ValueError(f"the experts' operands cannot form one grouped operand: {problem}.")


def _row_scaled(spec):
    # The stacked NVFP4 operand's spec: one amax per storage row. block_2d only said how the
    # parts' scales were chosen (16x16 tiles, stored per row); the bytes are read the same way.
    if spec.row_scaled:
        return spec
    return dataclasses.replace(spec, row_scaled=True, block_2d=False)


def cat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Rowwise left operands [m_e, K] as one [sum m_e, K] operand (bytes concatenated)."""
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
                         spec=_row_scaled(first.spec))


def _stack(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
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
                         spec=_row_scaled(first.spec))


def _view(part: QuantizedTensor, stack: QuantizedTensor, e: int) -> QuantizedTensor:
    """Expert e's operand as it was built (class, spec, amax shape), on the stack's bytes."""
    fields = {"qdata": stack.qdata[e], "scale": stack.scale[e]}
    if isinstance(part, NVFP4Tensor):
        fields["amax"] = stack.amax[e] if part.amax.dim() else stack.amax[e].reshape(-1)[0]
    return part.replace(**fields)


@dataclasses.dataclass
class ExpertStack:
    """A grouped linear's weight operands: `ops[e]` expert e's (as quantize_weight built it, on
    the stacks' bytes), `rows` the fprop operand [E, N, K] (rowwise), `cols` the dgrad operand
    [E, N, K] (columnwise), or None where the experts' operands have no such usage."""

    ops: list
    rows: QuantizedTensor | None
    cols: QuantizedTensor | None

    @classmethod
    def build(cls, ops: Sequence[QuantizedTensor]) -> "ExpertStack":
        """Stack the experts' weight operands (a HybridTensor or one rowwise tensor each)."""
        hybrid = isinstance(ops[0], HybridTensor)
        row_parts = [op.rowwise if hybrid else op for op in ops]
        col_parts = [op.columnwise for op in ops] if hybrid else None
        _check(row_parts)
        rows = _stack(row_parts)
        cols = None
        if col_parts is not None and part_problem(col_parts) is None:
            cols = _stack(col_parts)
        views = []
        for e, op in enumerate(ops):
            r = _view(row_parts[e], rows, e)
            if not hybrid:
                views.append(r)
                continue
            c = _view(col_parts[e], cols, e) if cols is not None else op.columnwise
            views.append(op.replace(rowwise=r, columnwise=c))
        return cls(views, rows, cols)

    def tensors(self) -> list:
        """What the weight cache copies in place on a gated update: the stacks (the views
        follow), plus the operands the stacks do not hold."""
        out = [self.rows]
        if self.cols is not None:
            out.append(self.cols)
        elif isinstance(self.ops[0], HybridTensor):
            out.extend(op.columnwise for op in self.ops)
        return out
