"""The ops FSDP2 and DTensor call on a quantized parameter, and where they stop.

`fully_shard` turns a parameter into its dim-0 shard with, in order: `torch.chunk` (aten.split,
in the shared op table), `new_zeros` of the padded shard size, `narrow(...).copy_(shard)`,
`view(-1)` (kept as FSDP's flat `_sharded_param_data`, used only by parameters without
all-gather hooks) and, after the all-gather, `torch.as_strided(full, size, contiguous strides)`.
This module adds the three that were missing, for every quantized class:

- `new_zeros(size)`: a tensor of the same class and metadata whose bytes are all zero (codes
  0 decode to 0 whatever the scale), resized along dim 0 only: [Note: quantized FSDP2 shards]
  in qtensor/distributed/fsdp.py says which storage dim carries dim 0.
- `as_strided`: only the identity (same size, contiguous strides, offset 0); anything else
  would reinterpret packed codes and raises.
- `view(-1)` (`flat_view`, called from each class's view handler): the real flattening where
  the blocks stay whole in row-major order (rowwise, one amax per tensor), else a
  `QuantizedStorageView` that holds the tensor but refuses every op, so nothing decodes bytes
  in an order they were not written in.
"""

from __future__ import annotations

import torch

from qtensor.distributed.fsdp import rows_resized
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import ROWWISE
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor

aten = torch.ops.aten


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


@QuantizedTensor.implements(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    x, size = args[0], torch.Size(args[1])
    if kwargs.get("dtype") not in (None, x.dtype):
        raise TypeError(
            f"{type(x).__name__}.new_zeros keeps the tensor's dtype {x.dtype}; got dtype="
            f"{kwargs['dtype']}. Quantized zeros are codes, not values of another dtype."
        )
    if len(size) != x.dim() or size[1:] != x.shape[1:]:
        raise ValueError(
            f"{type(x).__name__}.new_zeros changes dim 0 only (the dim FSDP2 shards); got "
            f"{tuple(size)} for a tensor of shape {tuple(x.shape)}."
        )
    return rows_resized(x, size[0], torch.zeros_like, torch.zeros)


@QuantizedTensor.implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    x, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if size != tuple(x.shape) or stride != contiguous_strides(size) or offset not in (None, 0):
        raise ValueError(
            f"{type(x).__name__} supports as_strided only as the identity (size "
            f"{tuple(x.shape)}, strides {contiguous_strides(x.shape)}, offset 0), as FSDP2 uses "
            f"it; got size {size}, strides {stride}, offset {offset}. Packed codes and block "
            "scales cannot be restrided."
        )
    return x.replace()


def flat_view(x: QuantizedTensor):
    """`x.view(-1)`: a real 1-D view where blocks stay whole, else a QuantizedStorageView."""
    n = x.numel()
    if isinstance(x, NVFP4Tensor) and x.axis == ROWWISE and not x.row_scaled:
        # Row-major order keeps each 1x16 block (and each row of a 16x16 tile, whose scale is
        # stored on every row) contiguous, so the 1-D tensor decodes to the same values.
        return x.replace(shape=(n,), qdata=x.qdata.view(-1), scale=x.scale.view(-1),
                         block_2d=False)
    if isinstance(x, MXFP8Tensor) and x.axis == ROWWISE:
        return x.replace(shape=(n,), qdata=x.qdata.view(-1), scale=x.scale.view(-1))
    return QuantizedStorageView(x)


class QuantizedStorageView(torch.Tensor):
    """A 1-D stand-in for a quantized tensor whose bytes have no row-major 1-D reading.

    FSDP2 keeps `view(-1)` of every sharded parameter; for a columnwise, row-scaled or hybrid
    tensor that view cannot be a quantized tensor (its blocks or amaxes run across rows), so it
    is this object, which holds the tensor and refuses every op but detach.
    """

    @staticmethod
    def __new__(cls, source: QuantizedTensor):
        self = torch.Tensor._make_wrapper_subclass(
            cls, (source.numel(),), dtype=source.dtype, device=source.device
        )
        self.source = source
        return self

    def __repr__(self):
        return f"QuantizedStorageView(of {self.source!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default):
            return QuantizedStorageView(args[0].source)
        raise NotImplementedError(
            f"{func} on the flat view of {args[0].source!r}: its codes, scales and amaxes run "
            "across rows, so a 1-D reading of them has no values. Use the quantized tensor "
            "itself (FSDP2 keeps this view only for parameters without all-gather hooks)."
        )
