"""HybridTensor: a rowwise operand in one format and a columnwise operand in another.

Each side is a full quantized tensor with its own metadata; a GEMM takes the side whose blocks
run along its reduction dim (the rowwise side as a left operand, the columnwise side as a right
operand), so one hybrid weight serves fprop in NVFP4 and dgrad in MXFP8. `columnwise_source`
records where the columnwise bytes came from: "original" (the high-precision input quantized
again) or "rowwise_dequantized" (the rowwise side decoded to the input's dtype, then quantized:
that intermediate rounding is part of the contract).
"""

from __future__ import annotations

import dataclasses

import torch

from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp4 import MXFP4Spec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import (
    COLUMNWISE,
    ROWWISE,
    check_hp_input,
    flips_last_two,
    require_finite,
)
from qtensor.tensors.fp8_block import FP8BlockTensor
from qtensor.tensors.layout import flat_view
from qtensor.tensors.mxfp4 import MXFP4Tensor
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor

aten = torch.ops.aten
Spec = NVFP4Spec | MXFP8Spec | FP8BlockSpec | MXFP4Spec
SOURCES = ("original", "rowwise_dequantized")


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """What a HybridTensor holds: the spec of each side and where the columnwise bytes came from."""

    rowwise: Spec
    columnwise: Spec
    columnwise_source: str = "original"


def tensor_class(spec: Spec) -> type[QuantizedTensor]:
    if isinstance(spec, NVFP4Spec):
        return NVFP4Tensor
    if isinstance(spec, MXFP8Spec):
        return MXFP8Tensor
    if isinstance(spec, FP8BlockSpec):
        return FP8BlockTensor
    if isinstance(spec, MXFP4Spec):
        return MXFP4Tensor
    raise TypeError(
        f"expected an NVFP4Spec, MXFP8Spec, FP8BlockSpec or MXFP4Spec; got {type(spec).__name__}."
    )


def quantize_spec(x, spec: Spec, *, generator=None, check_finite=True) -> QuantizedTensor:
    """Quantize x with a spec, whatever its format."""
    return tensor_class(spec).from_spec(x, spec, generator=generator, check_finite=check_finite)


def is_gradient_cast(row_spec, col_spec, source: str) -> bool:
    """MXFP8 rowwise + 1D NVFP4 columnwise of the same input: the dgrad-in-MXFP8 recipe's
    grad_output, which one kernel writes from one read (the same bytes as two casts)."""
    return (
        isinstance(row_spec, MXFP8Spec)
        and isinstance(col_spec, NVFP4Spec)
        and not col_spec.block_2d
        and source == "original"
    )


def gradient_cast(x, row_spec: MXFP8Spec, col_spec: NVFP4Spec, generator=None):
    """(MXFP8 rowwise, NVFP4 columnwise) tensors of a 2-D x, from one read of it."""
    from qtensor.formats import mxfp8, nvfp4
    from qtensor.ops import quant

    mxfp8.check_shape(x.shape, row_spec)
    nvfp4.check_shape(x.shape, col_spec)
    mx_data, nv_data, backend = quant.quantize_hybrid_grad(
        x, row_spec.scale_rule, col_spec, generator
    )
    return (MXFP8Tensor.wrap(x, row_spec, mx_data, backend),
            NVFP4Tensor.wrap(x, col_spec, nv_data, backend))


class HybridTensor(QuantizedTensor):
    tensor_data_names = ("rowwise", "columnwise")
    tensor_attribute_names = ("columnwise_source",)

    @classmethod
    def from_hp(
        cls,
        x: torch.Tensor,
        *,
        rowwise: Spec,
        columnwise: Spec,
        columnwise_source: str = "original",
        generator: torch.Generator | None = None,
        check_finite: bool = True,
    ) -> "HybridTensor":
        """Quantize a 2-D tensor into both sides. The slot decides each side's orientation."""
        if columnwise_source not in SOURCES:
            raise ValueError(
                f"columnwise_source must be one of {SOURCES}; got {columnwise_source!r}."
            )
        check_hp_input(x, "HybridTensor")
        if x.dim() != 2:
            raise ValueError(f"HybridTensor takes a 2-D tensor; got shape {tuple(x.shape)}.")
        row_spec = dataclasses.replace(rowwise, columnwise=False)
        col_spec = dataclasses.replace(columnwise, columnwise=True)
        if is_gradient_cast(row_spec, col_spec, columnwise_source):
            row, col = gradient_cast(x, row_spec, col_spec, generator)
        else:
            row = quantize_spec(x, row_spec, generator=generator, check_finite=False)
            src = row.dequantize(x.dtype) if columnwise_source == "rowwise_dequantized" else x
            col = quantize_spec(src, col_spec, generator=generator, check_finite=False)
        if check_finite:  # the rowwise side is always quantized from x itself
            require_finite(x, "HybridTensor", row)
        return cls(x.shape, x.dtype, x.device, rowwise=row, columnwise=col,
                   columnwise_source=columnwise_source)

    def __repr__(self):
        return (
            f"HybridTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"columnwise_source={self.columnwise_source},\n  rowwise={self.rowwise!r},\n  "
            f"columnwise={self.columnwise!r})"
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rowwise side decoded (the forward operand)."""
        return self.rowwise.dequantize(dtype or self.dtype)

    # ---- layout protocol ([Note: layout protocol] in qtensor/tensors/base.py): a composite --

    @property
    def spec(self) -> HybridSpec:
        return HybridSpec(self.rowwise.spec, self.columnwise.spec, self.columnwise_source)

    @classmethod
    def inner_layout(cls, shape: torch.Size, attrs: dict) -> dict:
        if len(shape) != 2:
            raise ValueError(f"a HybridTensor has 2 dims; got {list(shape)}.")
        return {"rowwise": ROWWISE, "columnwise": COLUMNWISE}

    def gemm_operand(self, side: str):
        """The rowwise side as a left operand, the columnwise side as a right operand."""
        return self.rowwise if side == "left" else self.columnwise


@HybridTensor.implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    x = args[0]
    if not flips_last_two(x, func, args):
        return x.replace()  # a view op must return a new tensor, even for a no-op transpose
    # The rowwise side of the transpose is the transposed columnwise side, and vice versa.
    return x.replace(
        shape=(x.shape[1], x.shape[0]),
        rowwise=x.columnwise.t(),
        columnwise=x.rowwise.t(),
    )


@HybridTensor.implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    x = args[0]
    if len(args[1]) == 1 and x.dim() > 1:  # view(-1), as FSDP2 takes of every parameter
        return flat_view(x)
    if torch.Size(args[1]) != x.shape:
        raise ValueError(f"HybridTensor cannot be reshaped: {tuple(x.shape)} -> {tuple(args[1])}.")
    return x.replace()


@HybridTensor.implements([aten.slice.Tensor, aten.select.int])
def _slice(func, args, kwargs):
    x = args[0]
    row, col = func(x.rowwise, *args[1:]), func(x.columnwise, *args[1:])
    if row.dim() != 2:
        raise ValueError("HybridTensor.select would leave a 1-D tensor; slice instead.")
    return x.replace(shape=row.shape, rowwise=row, columnwise=col)
