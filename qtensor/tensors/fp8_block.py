"""FP8BlockTensor: E4M3 data with one fp32 power-of-two scale per 1x128 block or 128x128 tile.

Layout [Note: FP8 block storage] (the bytes of qtensor/formats/fp8_block.py; docs/formats.md):
qdata always has the logical shape, as MXFP8's does.
    block "1x128", rowwise     blocks along the last dim    scale [*lead, R, C/128]
    block "1x128", columnwise  blocks along dim 0 (2-D)     scale [R/128, C]
    block "128x128"            square tiles (2-D)           scale [R/128, C/128]
Transposing the last two dims transposes both views; a 1x128 tensor flips `axis`, a tile tensor
stays a tile tensor (a square tile has no direction), so one tile tensor is a GEMM operand on
either side: W [N, K] as the right operand of dgrad, W.t() as the right operand of fprop. A tile
tensor's `axis` is always "rowwise".
"""

from __future__ import annotations

import torch

from qtensor.backends import GemmBackend, QuantBackend, quant_backend
from qtensor.formats import fp8_block as ref
from qtensor.formats.fp8_block import FP8BlockData, FP8BlockSpec
from qtensor.ops import fp8_block as fp8_block_op
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.layout import slice_op, view_op
from qtensor.tensors.common import (
    COLUMNWISE,
    ROWWISE,
    check_hp_input,
    flips_last_two,
    normalize_dim,
    require_finite,
)

aten = torch.ops.aten
BLOCK = ref.BLOCK
TILES = "128x128"


class FP8BlockTensor(QuantizedTensor):
    gemm_format = "fp8_block"
    block = property(lambda self: self.spec.block)  # "1x128" or "128x128" (weight tiles)
    tensor_data_names = ("qdata", "scale")
    spec_type = FP8BlockSpec
    tensor_attribute_names = (
        "axis",  # "rowwise" or "columnwise" (1x128 along dim 0); tiles are "rowwise"
        "spec",  # the FP8BlockSpec the bytes were quantized with ([Note: spec on the tensor])
        "quant_backend",  # QuantBackend value that produced the bytes (bytes never depend on it)
        "gemm_backend",  # GemmBackend value its products run on (emulated, or scaled_mm)
    )

    @classmethod
    def from_spec(cls, x, spec: FP8BlockSpec, *, generator=None,
                  check_finite=True) -> "FP8BlockTensor":
        """Quantize x: 1x128 blocks on a GPU with the project's kernels through
        qtensor::fp8_block_quantize (qtensor/ops/fp8_block.py), else (and 128x128 tiles) with
        the reference; the same bytes."""
        if generator is not None:
            raise TypeError(
                "FP8 block scaling rounds to nearest; it takes no stochastic-rounding generator "
                f"(got {type(generator).__name__}). Leave generator=None."
            )
        check_hp_input(x, "FP8 block")
        backend = quant_backend(x.device)
        if backend is QuantBackend.CUDA and spec.block == "1x128":
            data = FP8BlockData(*fp8_block_op.fp8_block_quantize(x, spec.columnwise))
        else:
            backend, data = QuantBackend.REFERENCE, ref.quantize(x, spec)
        out = cls.wrap(x, spec, data, backend)
        if check_finite:
            require_finite(x, "FP8 block", out)
        return out

    @classmethod
    def gemm_backend_for(cls, device) -> str:
        """The exact emulation on every device: a plain FP8 block tensor multiplies as the
        reference does. The MXFP4 QAT host asks for the native GEMM when configured to
        (MXFP4QATConfig.native_gemm; docs/qat.md, "Status")."""
        return GemmBackend.EMULATED.value

    @classmethod
    def wrap(cls, x, spec: FP8BlockSpec, data: FP8BlockData, backend: QuantBackend,
             gemm_backend: GemmBackend = GemmBackend.EMULATED) -> "FP8BlockTensor":
        """The tensor holding `data` (FP8BlockData of x quantized with spec). Its products run
        the exact emulation unless `gemm_backend` asks for the native scaled_mm call, whose
        sums differ from it within a stated bound (docs/qat.md, "Status")."""
        qdata, scale = data
        return cls(
            x.shape,
            x.dtype,
            x.device,
            qdata=qdata,
            scale=scale,
            spec=spec,
            axis=COLUMNWISE if spec.columnwise else ROWWISE,
            quant_backend=backend.value,
            gemm_backend=GemmBackend(gemm_backend).value,
        )

    def input_was_finite(self) -> bool:
        """Whether the input held no NaN and no Inf: a block with one has a NaN scale, and no
        finite block does (one reduction over the scales, one device sync)."""
        return not bool(torch.isnan(self.scale).any())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded tensor (exact in fp32: E4M3 times a power of two), logical layout."""
        return ref.dequantize(self.qdata, self.scale, self.spec_of_bytes(), dtype or self.dtype)

    def unit_values(self) -> torch.Tensor:
        """The exact fp32 values a GEMM multiplies (no per-tensor factor)."""
        return ref.dequantize(self.qdata, self.scale, self.spec_of_bytes())

    def spec_of_bytes(self) -> FP8BlockSpec:
        return FP8BlockSpec(self.block, columnwise=self.axis == COLUMNWISE)

    def block_dims(self) -> tuple[int, ...]:
        """The logical dims one scale covers 128 elements of."""
        if self.block == TILES:
            return (0, 1)
        return (self.dim() - 1,) if self.axis == ROWWISE else (0,)

    # ---- layout protocol ([Note: layout protocol] in qtensor/tensors/base.py) ---------------

    def shard_dims(self) -> dict[str, int | None]:
        return {"qdata": 0, "scale": 0}  # both keep the logical layout

    def block_size(self, dim: int) -> int:
        return BLOCK if normalize_dim(dim, self.dim()) in self.block_dims() else 1

    def flat(self) -> "FP8BlockTensor | None":
        if self.block == TILES or self.axis != ROWWISE:
            return None
        return self.replace(shape=(self.numel(),), qdata=self.qdata.view(-1),
                            scale=self.scale.view(-1))

    @classmethod
    def inner_layout(cls, shape: torch.Size, attrs: dict) -> dict:
        block, col = attrs["spec"].block, attrs["axis"] == COLUMNWISE
        if block not in ("1x128", TILES) or (block == TILES and col):
            raise ValueError(f"FP8 block {block!r} with axis {attrs['axis']!r} is no layout.")
        two_d = block == TILES or col
        if not shape or (two_d and len(shape) != 2) or (two_d and shape[0] % BLOCK) or (
                not col and shape[-1] % BLOCK):
            raise ValueError(f"{list(shape)} cannot hold FP8 {block} {attrs['axis']} blocks.")
        if block == TILES:
            scale = [shape[0] // BLOCK, shape[1] // BLOCK]
        elif col:
            scale = [shape[0] // BLOCK, shape[1]]
        else:
            scale = [*shape[:-1], shape[-1] // BLOCK]
        return {"qdata": (shape, torch.float8_e4m3fn), "scale": (torch.Size(scale), torch.float32)}

    def gemm_operand(self, side: str) -> "FP8BlockTensor":
        """A tile tensor serves either side (its tiles run along both dims); a 1x128 tensor the
        side its blocks run along (the base rule)."""
        return self if self.block == TILES else super().gemm_operand(side)

    def gemm_rows(self, logical_rows: bool) -> tuple:
        # (data, scale, amax, bound, tiles): data keeps the logical layout, so a right
        # operand's rows along K are the transposed views of both.
        tiles = self.block == TILES
        if logical_rows:
            return self.qdata, self.scale, None, None, tiles
        return self.qdata.t(), self.scale.t(), None, None, tiles

    def pair_problem(self, other: "QuantizedTensor | None") -> str | None:
        """qtensor::fp8_block_mm multiplies two FP8 block operands, 1x128 rows on the left."""
        if other is None:
            return ("an FP8 block GEMM multiplies two FP8 block operands; quantize the "
                    "high-precision one with an FP8BlockSpec")
        if self.block == TILES:
            return ("the left operand of an FP8 block GEMM must have 1x128 blocks (tiles go on "
                    "the right); pass the product's transpose")
        return None


@FP8BlockTensor.implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    x = args[0]
    if not flips_last_two(x, func, args):
        return x.replace()  # a view op must return a new tensor, even for a no-op transpose
    axis = x.axis if x.block == TILES else (COLUMNWISE if x.axis == ROWWISE else ROWWISE)
    return x.replace(
        shape=(*x.shape[:-2], x.shape[-1], x.shape[-2]),
        qdata=x.qdata.transpose(-1, -2),
        scale=x.scale.transpose(-1, -2),
        axis=axis,
    )


FP8BlockTensor.implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])(
    view_op)


FP8BlockTensor.implements(aten.slice.Tensor)(slice_op)
