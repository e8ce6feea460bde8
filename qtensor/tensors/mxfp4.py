"""MXFP4Tensor: packed E2M1 codes with one UE8M0 scale code per 1x32 block.

Layout [Note: MXFP4 tensor storage] (the bytes of [Note: MXFP4 storage] in
qtensor/formats/mxfp4.py; docs/formats.md, "MXFP4"): the logical tensor is [*lead, R, C].
Rowwise (blocks along the last dim) stores qdata uint8 [*lead, R, C/2] and scale uint8
[*lead, R, C/32]. Columnwise (blocks along dim -2) stores the transpose: qdata [*lead, C, R/2],
scale [*lead, C, R/32], so the rows of the storage are the columns of the tensor, as NVFP4's
columnwise storage is. Transposing the last two dims flips `axis` and touches no byte: a gpt-oss
expert weight [E, H, 2I] is the columnwise view of the checkpoint's [E, 2I, H] matrices.

The scales are kept as the checkpoint's uint8 codes (not float8_e8m0fnu): the file's bytes are
the tensor's bytes with no dtype reinterpretation, and every device and torch.compile backend
handles uint8 (CPU Inductor has no e8m0 type). Products run the exact emulated reference
(qtensor::mxfp4_mm) on every device until an MXFP4 kernel exists (docs/gemm.md).
"""

from __future__ import annotations

import torch

from qtensor.backends import GemmBackend, QuantBackend
from qtensor.formats import mxfp4 as ref
from qtensor.formats.mxfp4 import MXFP4Data, MXFP4Spec
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import (
    COLUMNWISE,
    ROWWISE,
    block_dim_size,
    check_hp_input,
    flips_last_two,
    normalize_dim,
    require_finite,
    transposed_storage_dim,
)
from qtensor.tensors.layout import slice_op, view_op

aten = torch.ops.aten
BLOCK = ref.BLOCK
_BYTES_PER_BLOCK = BLOCK // 2


class MXFP4Tensor(QuantizedTensor):
    gemm_format = "mxfp4"
    tensor_data_names = ("qdata", "scale")
    spec_type = MXFP4Spec
    tensor_attribute_names = (
        "axis",  # "rowwise" or "columnwise": which logical dim the 32-element blocks run along
        "spec",  # the MXFP4Spec the bytes were quantized with ([Note: spec on the tensor])
        "quant_backend",  # QuantBackend value that produced the bytes (bytes never depend on it)
        "gemm_backend",  # GemmBackend value its products run on (the emulated reference)
    )

    @classmethod
    def from_hp(cls, x: torch.Tensor, *, columnwise: bool = False,
                check_finite: bool = True) -> "MXFP4Tensor":
        """Quantize a high-precision tensor (columnwise: blocks along dim -2)."""
        return cls.from_spec(x, MXFP4Spec(columnwise), check_finite=check_finite)

    @classmethod
    def from_spec(cls, x, spec: MXFP4Spec, *, generator=None, check_finite=True) -> "MXFP4Tensor":
        """Quantize x with the reference (qtensor.formats.mxfp4.quantize, the only
        implementation of these bytes)."""
        if generator is not None:
            raise TypeError(
                "MXFP4 rounds to nearest; it takes no stochastic-rounding generator (got "
                f"{type(generator).__name__}). Leave generator=None."
            )
        check_hp_input(x, "MXFP4")
        if spec.columnwise and x.dim() < 2:
            raise ValueError(f"MXFP4 columnwise needs at least 2 dims; got shape {tuple(x.shape)}.")
        data = ref.quantize(x.transpose(-1, -2) if spec.columnwise else x)
        out = cls.wrap(x.shape, x.dtype, spec, data, QuantBackend.REFERENCE)
        if check_finite:
            require_finite(x, "MXFP4", out)
        return out

    @classmethod
    def from_bytes(cls, blocks: torch.Tensor, scales: torch.Tensor, *,
                   dtype: torch.dtype = torch.bfloat16) -> "MXFP4Tensor":
        """A rowwise tensor [..., R, K] from stored bytes, as gpt-oss checkpoints and
        qtensor.qat.export_weight hold them: blocks uint8 [..., R, K/32, 16] (element 2j in the
        low nibble) and UE8M0 scale codes uint8 [..., R, K/32]. Nothing is re-encoded: qdata is
        the blocks viewed as [..., R, K/2] and scale is `scales` itself. A scale code 255 (NaN)
        decodes its block to NaN. `.transpose(-1, -2)` gives the columnwise view (a weight
        stored [N, K] used as the right operand [K, N])."""
        if blocks.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != _BYTES_PER_BLOCK:
            raise ValueError(
                f"MXFP4 blocks must be uint8 [..., R, K/32, {_BYTES_PER_BLOCK}]; got "
                f"{blocks.dtype} {tuple(blocks.shape)}.")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ValueError(
                f"MXFP4 scales must be uint8 UE8M0 codes {list(blocks.shape[:-1])} (the blocks' "
                f"shape without its last dim); got {scales.dtype} {tuple(scales.shape)}.")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"dtype (of the products) must be float32, bfloat16 or float16; "
                            f"got {dtype}.")
        if blocks.numel() == 0:
            raise ValueError(f"MXFP4 blocks must be non-empty; got {tuple(blocks.shape)}.")
        nb = blocks.shape[-2]
        qdata = blocks.reshape(*blocks.shape[:-2], nb * _BYTES_PER_BLOCK)
        shape = (*blocks.shape[:-2], nb * BLOCK)
        return cls.wrap(shape, dtype, MXFP4Spec(), MXFP4Data(qdata, scales),
                        QuantBackend.REFERENCE)

    @classmethod
    def wrap(cls, shape, dtype, spec: MXFP4Spec, data: MXFP4Data,
             backend: QuantBackend) -> "MXFP4Tensor":
        """The tensor of logical `shape` holding `data` (storage rows as [Note: MXFP4 tensor
        storage] says for spec.columnwise)."""
        qdata, scale = data
        return cls(shape, dtype, qdata.device, qdata=qdata, scale=scale,
                   axis=COLUMNWISE if spec.columnwise else ROWWISE, spec=spec,
                   quant_backend=backend.value,
                   gemm_backend=cls.gemm_backend_for(qdata.device))

    @classmethod
    def gemm_backend_for(cls, device) -> str:
        """The exact emulation on every device: no MXFP4 kernel exists yet (docs/gemm.md)."""
        return GemmBackend.EMULATED.value

    def input_was_finite(self) -> bool:
        """Whether the input held no NaN and no Inf: a block with one has scale code 255, and
        no finite block does (one reduction over the scales, one device sync)."""
        return int(self.scale.max()) != ref.NAN_CODE

    # ---- decoding -----------------------------------------------------------------------------

    def _to_logical(self, storage_values: torch.Tensor) -> torch.Tensor:
        return storage_values.transpose(-1, -2) if self.axis == COLUMNWISE else storage_values

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded tensor (exact in fp32; in bf16 too, whose exponent range is fp32's) in
        the logical layout."""
        return self.unit_values().to(dtype or self.dtype).contiguous()

    def unit_values(self) -> torch.Tensor:
        """value(q) * 2**(c - 127) in fp32, logical layout: the exact operand a GEMM multiplies
        (MXFP4 has no per-tensor factor)."""
        return self._to_logical(ref.dequantize(self.qdata, self.scale))

    # ---- layout protocol ([Note: layout protocol] in qtensor/tensors/base.py) ---------------

    def storage_dim(self, dim: int) -> tuple[int, bool]:
        """(storage dim, is block dim) for a logical dim."""
        return transposed_storage_dim(self.axis, self.dim(), dim)

    def shard_dims(self) -> dict[str, int | None]:
        sdim, _ = self.storage_dim(0)
        return {"qdata": sdim, "scale": sdim}

    def block_size(self, dim: int) -> int:
        return BLOCK if self.storage_dim(dim)[1] else 1

    def flat(self) -> "MXFP4Tensor | None":
        if self.axis != ROWWISE:
            return None
        # Row-major order keeps each 1x32 block contiguous: the 1-D tensor decodes the same.
        return self.replace(shape=(self.numel(),), qdata=self.qdata.reshape(-1),
                            scale=self.scale.reshape(-1))

    @classmethod
    def inner_layout(cls, shape: torch.Size, attrs: dict) -> dict:
        col = attrs["axis"] == COLUMNWISE
        bdim = block_dim_size(shape, attrs["axis"], BLOCK)
        rows = [*shape[:-2], shape[-1]] if col else list(shape[:-1])
        return {"qdata": (torch.Size([*rows, bdim // 2]), torch.uint8),
                "scale": (torch.Size([*rows, bdim // BLOCK]), torch.uint8)}

    def gemm_rows(self, logical_rows: bool) -> tuple:
        # Rowwise storage [.., M, K/2] is a left operand's rows; columnwise storage [.., N, K/2]
        # is a right operand's (gemm_operand has checked the axis).
        return self.qdata, self.scale


@MXFP4Tensor.implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    x = args[0]
    if not flips_last_two(x, func, args):
        return x.replace()  # a view op must return a new tensor, even for a no-op transpose
    return x.replace(shape=(*x.shape[:-2], x.shape[-1], x.shape[-2]),
                     axis=COLUMNWISE if x.axis == ROWWISE else ROWWISE)


MXFP4Tensor.implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])(
    view_op)


MXFP4Tensor.implements(aten.slice.Tensor)(slice_op)


@MXFP4Tensor.implements(aten.select.int)
def _select(func, args, kwargs):
    x, dim, index = args
    sdim, is_block = x.storage_dim(dim)
    if is_block:
        raise ValueError(
            f"MXFP4Tensor cannot select along its block dim {dim} (shape {tuple(x.shape)}): "
            f"that would split a {BLOCK}-element block."
        )
    dim = normalize_dim(dim, x.dim())
    if not -x.shape[dim] <= index < x.shape[dim]:
        raise IndexError(f"index {index} is out of bounds for dim {dim} of size {x.shape[dim]}.")
    index = index + x.shape[dim] if index < 0 else index
    shape = [s for i, s in enumerate(x.shape) if i != dim]
    # Selecting the last dim of a columnwise tensor leaves blocks along the new last dim.
    axis = ROWWISE if (x.axis == COLUMNWISE and sdim == x.qdata.dim() - 2) else x.axis
    return x.replace(shape=shape, qdata=x.qdata.select(sdim, index),
                     scale=x.scale.select(sdim, index), axis=axis)
