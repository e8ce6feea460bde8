"""MXFP8Tensor: E4M3 data with one UE8M0 scale per 32 elements.

Layout [Note: MXFP8 storage]: qdata always has the logical shape (columnwise data is not
transposed). Rowwise scale is [*lead, R, C/32]; columnwise (32x1 blocks along dim -2) scale is
[*lead, R/32, C]. Transposing the last two dims transposes both views and flips `axis`.
"""

from __future__ import annotations

import torch

from qtensor.formats import mxfp8 as ref
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.backends import resolve_gemm_backend
from qtensor.ops import quant
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.layout import slice_op, view_op
from qtensor.tensors.common import (
    COLUMNWISE,
    ROWWISE,
    block_dim_size,
    check_hp_input,
    flips_last_two,
    normalize_dim,
    require_finite,
)

aten = torch.ops.aten
BLOCK = ref.BLOCK


class MXFP8Tensor(QuantizedTensor):
    gemm_format = "mxfp8"
    tensor_data_names = ("qdata", "scale")
    spec_type = MXFP8Spec
    tensor_attribute_names = (
        "axis",  # "rowwise" (1x32 blocks along the last dim) or "columnwise" (32x1 along dim -2)
        "spec",  # the MXFP8Spec the bytes were quantized with ([Note: spec on the tensor])
        "act_spec",  # spec that F.linear uses to quantize the activation, or None (weight-only)
        "quant_backend",  # QuantBackend value that produced the bytes (bytes never depend on it)
        "gemm_backend",  # GemmBackend value its products run on
    )
    # How version 1 checkpoints and earlier pickles stored the spec (see NVFP4Tensor).
    legacy_attribute_names = ("axis", "scale_rule", "scale_layout", "act_spec", "quant_backend",
                              "gemm_backend")
    scale_rule = property(lambda self: self.spec.scale_rule)  # how the scales were chosen

    @classmethod
    def from_hp(
        cls,
        x: torch.Tensor,
        *,
        scale_rule: str = "rceil",
        columnwise: bool = False,
        check_finite: bool = True,
    ) -> "MXFP8Tensor":
        """Quantize a high-precision tensor. Columnwise takes a 2-D tensor [M, K]."""
        return cls.from_spec(x, MXFP8Spec(scale_rule, columnwise), check_finite=check_finite)

    @classmethod
    def from_spec(cls, x, spec: MXFP8Spec, *, generator=None, check_finite=True) -> "MXFP8Tensor":
        check_hp_input(x, "MXFP8")
        data, backend = quant.quantize_mxfp8(x, spec)
        out = cls.wrap(x, spec, data, backend)
        if check_finite:
            require_finite(x, "MXFP8", out)
        return out

    def input_was_finite(self) -> bool:
        """Whether the input held no NaN and no Inf: a block with one has the NaN scale code
        0xFF, and no finite block does (one reduction over the scales, one device sync)."""
        return int(self.scale.view(torch.uint8).max()) != 255

    @classmethod
    def wrap(cls, x, spec: MXFP8Spec, data, backend) -> "MXFP8Tensor":
        """The tensor holding `data` (MXFP8Data of x quantized with spec)."""
        qdata, scale = data
        return cls(
            x.shape,
            x.dtype,
            x.device,
            qdata=qdata,
            scale=scale,
            axis=COLUMNWISE if spec.columnwise else ROWWISE,
            spec=spec,
            act_spec=None,
            quant_backend=backend.value,
            gemm_backend=resolve_gemm_backend(x.device).value,
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded tensor (exact in fp32), in the logical layout."""
        out = quant.dequantize_mxfp8(self.qdata, self.scale, self.axis == COLUMNWISE, dtype or self.dtype)
        return out.contiguous()

    def unit_values(self) -> torch.Tensor:
        """The exact fp32 values a GEMM multiplies (MXFP8 has no per-tensor factor)."""
        return ref.dequantize(self.qdata, self.scale, self.axis == COLUMNWISE)

    def block_dim(self) -> int:
        return self.dim() - 1 if self.axis == ROWWISE else self.dim() - 2

    # ---- layout protocol ([Note: layout protocol] in qtensor/tensors/base.py) ---------------

    @classmethod
    def upgrade_attributes(cls, attrs: dict) -> dict:
        """The attributes of a tensor stored before the spec moved onto it, as held now."""
        attrs = dict(attrs)
        attrs.pop("scale_layout", None)
        attrs["spec"] = MXFP8Spec(scale_rule=attrs.pop("scale_rule"),
                                  columnwise=attrs["axis"] == COLUMNWISE)
        return attrs

    def shard_dims(self) -> dict[str, int | None]:
        return {"qdata": 0, "scale": 0}  # both keep the logical layout (scale [R/32, C] too)

    def block_size(self, dim: int) -> int:
        return BLOCK if normalize_dim(dim, self.dim()) == self.block_dim() else 1

    def flat(self) -> "MXFP8Tensor | None":
        if self.axis != ROWWISE:
            return None
        return self.replace(shape=(self.numel(),), qdata=self.qdata.view(-1),
                            scale=self.scale.view(-1))

    @classmethod
    def inner_layout(cls, shape: torch.Size, attrs: dict) -> dict:
        col = attrs["axis"] == COLUMNWISE
        block_dim_size(shape, attrs["axis"], BLOCK)  # raises for a shape without whole blocks
        c = shape[-1]
        scale = [*shape[:-2], shape[-2] // BLOCK, c] if col else [*shape[:-1], c // BLOCK]
        return {"qdata": (shape, torch.float8_e4m3fn),
                "scale": (torch.Size(scale), torch.float8_e8m0fnu)}

    def gemm_rows(self, logical_rows: bool) -> tuple:
        # Columnwise data keeps the logical [.., K, N]: a right operand's rows are its transpose.
        if logical_rows:
            return self.qdata, self.scale
        return self.qdata.transpose(-1, -2), self.scale.transpose(-1, -2)


@MXFP8Tensor.implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    x = args[0]
    if not flips_last_two(x, func, args):
        return x.replace()  # a view op must return a new tensor, even for a no-op transpose
    return x.replace(
        shape=(*x.shape[:-2], x.shape[-1], x.shape[-2]),
        qdata=x.qdata.transpose(-1, -2),
        scale=x.scale.transpose(-1, -2),
        axis=COLUMNWISE if x.axis == ROWWISE else ROWWISE,
    )


MXFP8Tensor.implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])(
    view_op)


MXFP8Tensor.implements(aten.slice.Tensor)(slice_op)


@MXFP8Tensor.implements(aten.select.int)
def _select(func, args, kwargs):
    x, dim, index = args
    dim = normalize_dim(dim, x.dim())
    if dim == x.block_dim():
        raise ValueError(
            f"MXFP8Tensor cannot select along its block dim {dim} (shape {tuple(x.shape)}): "
            "that would split a 32-element block."
        )
    index = index + x.shape[dim] if index < 0 else index
    # Selecting the last dim of a columnwise tensor leaves blocks along the new last dim.
    axis = ROWWISE if (x.axis == COLUMNWISE and dim == x.dim() - 1) else x.axis
    return x.replace(
        shape=[s for i, s in enumerate(x.shape) if i != dim],
        qdata=x.qdata.select(dim, index),
        scale=x.scale.select(dim, index),
        axis=axis,
    )
