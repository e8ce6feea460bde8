"""NVFP4Tensor: packed E2M1 codes, E4M3 block scales and an fp32 amax (scalar or per row).

Layout [Note: NVFP4 storage]: the logical tensor is [*lead, R, C]. Rowwise (blocks along the
last dim) stores qdata [*lead, R, C/2] and scale [*lead, R, C/16]. Columnwise (blocks along dim
-2) stores the transpose: qdata [*lead, C, R/2], scale [*lead, C, R/16], so the rows of the
storage are the columns of the tensor (docs/formats.md, "Variants": columnwise). A row-scaled
amax has the storage's shape without its last dim. Transposing the last two dims flips `axis`
and touches no byte.
"""

from __future__ import annotations

import dataclasses

import torch

from qtensor.backends import QuantBackend, resolve_gemm_backend
from qtensor.formats import nvfp4 as ref
from qtensor.formats.fields import either
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.ops import quant
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import (
    COLUMNWISE,
    ROWWISE,
    block_dim_size,
    bytes_spec,
    check_hp_input,
    flips_last_two,
    normalize_dim,
    require_finite,
    slice_bounds,
    transposed_storage_dim,
)
from qtensor.tensors.layout import view_op

aten = torch.ops.aten
BLOCK = ref.BLOCK


class NVFP4Tensor(QuantizedTensor):
    gemm_format = "nvfp4"
    tensor_data_names = ("qdata", "scale", "amax")
    spec_type = NVFP4Spec
    tensor_attribute_names = (
        "axis",  # "rowwise" or "columnwise": which logical dim the 16-element blocks run along
        "spec",  # the NVFP4Spec the bytes were quantized with ([Note: spec on the tensor])
        "act_spec",  # spec that F.linear uses to quantize the activation, or None (weight-only)
        "quant_backend",  # QuantBackend value that produced the bytes (bytes never depend on it)
        "gemm_backend",  # GemmBackend value its products run on
    )
    # How version 1 checkpoints and earlier pickles stored the spec: unpacked, one attribute
    # per field, plus a `scale_layout` that only ever held "compact".
    legacy_attribute_names = ("axis", "block_2d", "row_scaled", "fourover6", "e4m3_bound", "rht",
                              "scale_layout", "act_spec", "quant_backend", "gemm_backend")

    # The spec's fields the layout and the GEMMs read, as attributes of the tensor.
    block_2d = property(lambda self: self.spec.block_2d)  # scales shared by 16x16 tiles
    row_scaled = property(lambda self: self.spec.row_scaled)  # one amax per storage row
    fourover6 = property(lambda self: self.spec.fourover6)  # how block scales were chosen
    e4m3_bound = property(lambda self: self.spec.e4m3_bound)  # B of the decode factor A / (6 B)
    rht = property(lambda self: self.spec.rht)  # Hadamard-transformed values (RHT pairs only)

    @classmethod
    def from_hp(
        cls,
        x: torch.Tensor,
        *,
        block_2d: bool = False,
        row_scaled: bool = False,
        fourover6: str | None = None,
        e4m3_bound: int = 448,
        rht: bool = False,
        stochastic_rounding: bool = False,
        generator: torch.Generator | None = None,
        columnwise: bool = False,
        check_finite: bool = True,
    ) -> "NVFP4Tensor":
        """Quantize a high-precision tensor. Columnwise takes a 2-D tensor [M, K]."""
        spec = NVFP4Spec(
            block_2d=block_2d,
            row_scaled=row_scaled,
            fourover6=fourover6,
            e4m3_bound=e4m3_bound,
            rht=rht,
            stochastic_rounding=stochastic_rounding,
            columnwise=columnwise,
        )
        return cls.from_spec(x, spec, generator=generator, check_finite=check_finite)

    @classmethod
    def from_spec(cls, x, spec: NVFP4Spec, *, generator=None, check_finite=True,
                  global_amax=None) -> "NVFP4Tensor":
        """`global_amax` (fp32) replaces x's own amax: a shard quantized as part of its whole."""
        check_hp_input(x, "NVFP4")
        if spec.columnwise and x.dim() != 2:
            raise ValueError(
                f"NVFP4 columnwise quantization takes a 2-D tensor; got shape {tuple(x.shape)}. "
                "Flatten the leading dims first (x.reshape(-1, x.shape[-1]))."
            )
        data, backend = quant.quantize_nvfp4(x, spec, generator, global_amax)
        out = cls.wrap(x, spec, data, backend)
        if check_finite:
            # A given global amax says nothing about x: then x's own amax is the evidence.
            evidence = out if global_amax is None else out.replace(amax=x.abs().amax().float())
            require_finite(x, "NVFP4", evidence)
        return out

    @classmethod
    def from_bytes(cls, qdata: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *,
                   dtype: torch.dtype = torch.bfloat16, e4m3_bound: int = 448,
                   act_spec: NVFP4Spec | None = None) -> "NVFP4Tensor":
        """A rowwise 2-D weight [N, K] from stored bytes: packed codes uint8 [N, K/2] (element 2j
        in the low nibble), E4M3 block scales [N, K/16] and its fp32 amax (0-d), as a
        checkpoint holds them (qtensor/checkpoint/pretrained.py). Nothing is re-encoded."""
        if qdata.dtype != torch.uint8 or qdata.dim() != 2:
            raise ValueError(f"NVFP4 codes must be uint8 [N, K/2]; got {qdata.dtype} "
                             f"{tuple(qdata.shape)}.")
        n, k = qdata.shape[0], 2 * qdata.shape[1]
        if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // BLOCK) or k % BLOCK:
            raise ValueError(f"NVFP4 block scales must be float8_e4m3fn [N, K/16] = "
                             f"{[n, k // BLOCK]} with K % 16 == 0; got {scale.dtype} "
                             f"{tuple(scale.shape)} for K = {k}.")
        if amax.dtype != torch.float32 or amax.numel() != 1:
            raise ValueError(f"the NVFP4 amax must be one float32 value; got {amax.dtype} "
                             f"{tuple(amax.shape)}.")
        if e4m3_bound not in ref.E4M3_BOUNDS:
            raise ValueError(f"e4m3_bound must be {either(ref.E4M3_BOUNDS)}; got {e4m3_bound}.")
        return cls(
            (n, k), dtype, qdata.device, qdata=qdata, scale=scale,
            amax=amax.reshape(()).to(qdata.device), axis=ROWWISE,
            spec=NVFP4Spec(e4m3_bound=e4m3_bound), act_spec=act_spec,
            quant_backend=QuantBackend.REFERENCE.value,
            gemm_backend=resolve_gemm_backend(qdata.device).value,
        )

    def input_was_finite(self) -> bool:
        """Whether the input held no NaN and no Inf, as its amax (x's torch.amax, of its RHT
        when rht) tells: True is certain; False may be an RHT overflow (one device sync)."""
        finite = torch.isfinite(self.amax)
        return bool(finite if finite.dim() == 0 else finite.all())

    @classmethod
    def wrap(cls, x, spec: NVFP4Spec, data, backend) -> "NVFP4Tensor":
        """The tensor holding `data` (reference-layout NVFP4Data of x quantized with spec)."""
        qdata, scale, amax = data
        if not spec.columnwise and x.dim() != 2:  # the kernels' 2-D results, back to x's dims
            lead = x.shape[:-1]
            qdata = qdata.reshape(*lead, qdata.shape[-1])
            scale = scale.reshape(*lead, scale.shape[-1])
            amax = amax.reshape(lead) if spec.row_scaled else amax
        return cls(
            x.shape,
            x.dtype,
            x.device,
            qdata=qdata,
            scale=scale,
            amax=amax,
            axis=COLUMNWISE if spec.columnwise else ROWWISE,
            spec=bytes_spec(spec),
            act_spec=None,
            quant_backend=backend.value,
            gemm_backend=resolve_gemm_backend(x.device).value,
        )

    # ---- decoding -----------------------------------------------------------------------------

    def _storage_2d(self):
        q = self.qdata.reshape(-1, self.qdata.shape[-1])
        s = self.scale.reshape(-1, self.scale.shape[-1])
        return q, s

    def _to_logical(self, storage_values: torch.Tensor) -> torch.Tensor:
        shape = (*self.qdata.shape[:-1], self.qdata.shape[-1] * 2)
        v = storage_values.reshape(shape)
        return v.transpose(-1, -2) if self.axis == COLUMNWISE else v

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded tensor (docs/formats.md, NVFP4 step 7) in the logical layout."""
        q, s = self._storage_2d()
        amax = self.amax.reshape(-1) if self.row_scaled else self.amax
        out = quant.dequantize_nvfp4(q, s, amax, self.e4m3_bound, dtype or self.dtype)
        return self._to_logical(out).contiguous()

    def unit_values(self) -> torch.Tensor:
        """value(q) * s_b in fp32, logical layout: the exact operand a GEMM multiplies."""
        q, s = self._storage_2d()
        return self._to_logical(ref.unit_values(q, s))

    def amax_for(self, side: str) -> torch.Tensor:
        """The amax broadcastable over a GEMM output: [.., M, 1] on the left, [.., 1, N] right."""
        if not self.row_scaled:
            return self.amax
        return self.amax.unsqueeze(-1) if side == "left" else self.amax.unsqueeze(-2)

    # ---- layout protocol ([Note: layout protocol] in qtensor/tensors/base.py) ---------------

    @classmethod
    def upgrade_attributes(cls, attrs: dict) -> dict:
        """The attributes of a tensor stored before the spec moved onto it (see
        `legacy_attribute_names`) as the class holds them now."""
        attrs = dict(attrs)
        fields = {n: attrs.pop(n) for n in ("block_2d", "row_scaled", "fourover6", "e4m3_bound",
                                            "rht")}
        attrs.pop("scale_layout", None)
        # A rowwise RHT tensor is the transpose view of a columnwise RHT operand: its spec is
        # that operand's (NVFP4Spec keeps RHT to columnwise operands).
        columnwise = attrs["axis"] == COLUMNWISE or fields["rht"]
        attrs["spec"] = NVFP4Spec(**fields, columnwise=columnwise)
        return attrs

    def shard_dims(self) -> dict[str, int | None]:
        sdim, _ = self.storage_dim(0)
        # Row-scaled amax has the storage shape minus its last dim: rowwise [*lead, R] follows
        # dim 0; columnwise [C] holds one amax per column over all rows, so every shard needs it.
        amax = sdim if (self.row_scaled and self.axis == ROWWISE) else None
        return {"qdata": sdim, "scale": sdim, "amax": amax}

    def block_size(self, dim: int) -> int:
        nd = self.dim()
        _, is_block = self.storage_dim(dim)
        in_tile = self.block_2d and normalize_dim(dim, nd) >= nd - 2
        return BLOCK if is_block or in_tile else 1

    def flat(self) -> "NVFP4Tensor | None":
        if self.axis != ROWWISE or self.row_scaled:
            return None
        # Row-major order keeps each 1x16 block (and each row of a 16x16 tile, whose scale is
        # stored on every row) contiguous, so the 1-D tensor decodes to the same values.
        return self.replace(shape=(self.numel(),), qdata=self.qdata.view(-1),
                            scale=self.scale.view(-1),
                            spec=dataclasses.replace(self.spec, block_2d=False))

    @classmethod
    def inner_layout(cls, shape: torch.Size, attrs: dict) -> dict:
        col = attrs["axis"] == COLUMNWISE
        bdim = block_dim_size(shape, attrs["axis"], BLOCK)
        rows = [*shape[:-2], shape[-1]] if col else list(shape[:-1])  # storage rows (a columnwise one's columns)
        return {
            "qdata": (torch.Size([*rows, bdim // 2]), torch.uint8),
            "scale": (torch.Size([*rows, bdim // BLOCK]), torch.float8_e4m3fn),
            "amax": (torch.Size(rows if attrs["spec"].row_scaled else []), torch.float32),
        }

    def gemm_rows(self, logical_rows: bool) -> tuple:
        # Rowwise storage [.., M, K/2] is a left operand's rows; columnwise storage [.., N, K/2]
        # is a right operand's.
        return self.qdata, self.scale, self.amax, self.e4m3_bound

    def pair_problem(self, other) -> str | None:
        if other is None:
            return ("An RHT-transformed NVFP4 operand needs an RHT-transformed partner"
                    if self.rht else None)
        if self.rht != other.rht:
            return ("NVFP4 RHT must be applied to both GEMM operands or neither (it cancels "
                    f"only in pairs); got rht={self.rht} x rht={other.rht}")
        return None

    # ---- layout helpers for the op table --------------------------------------------------------

    def storage_dim(self, dim: int) -> tuple[int, bool]:
        """(storage dim, is block dim) for a logical dim."""
        return transposed_storage_dim(self.axis, self.dim(), dim)


def _transposed(x: NVFP4Tensor) -> NVFP4Tensor:
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2])
    axis = COLUMNWISE if x.axis == ROWWISE else ROWWISE
    return x.replace(shape=shape, axis=axis)


@NVFP4Tensor.implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    x = args[0]
    if not flips_last_two(x, func, args):
        return x.replace()  # a view op must return a new tensor, even for a no-op transpose
    return _transposed(x)


NVFP4Tensor.implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])(
    view_op)


def _narrow(x: NVFP4Tensor, dim: int, start: int, length: int) -> NVFP4Tensor:
    sdim, is_block = x.storage_dim(dim)
    shape = list(x.shape)
    shape[normalize_dim(dim, x.dim())] = length
    if is_block:
        if start % BLOCK or length % BLOCK:
            raise ValueError(
                f"NVFP4Tensor slices along its block dim only at multiples of {BLOCK}; got "
                f"start {start}, length {length} on dim {dim} of {tuple(x.shape)}."
            )
        return x.replace(
            shape=shape,
            qdata=x.qdata.narrow(sdim, start // 2, length // 2),
            scale=x.scale.narrow(sdim, start // BLOCK, length // BLOCK),
        )
    if x.block_2d and sdim == x.qdata.dim() - 2 and (start % BLOCK or length % BLOCK):
        raise ValueError(
            f"NVFP4Tensor with 16x16 tiles slices rows only at multiples of {BLOCK}; got "
            f"start {start}, length {length} on dim {dim} of {tuple(x.shape)}."
        )
    return x.replace(
        shape=shape,
        qdata=x.qdata.narrow(sdim, start, length),
        scale=x.scale.narrow(sdim, start, length),
        amax=x.amax.narrow(sdim, start, length) if x.row_scaled else x.amax,
    )


@NVFP4Tensor.implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    x, dim, start, length = slice_bounds(*args)
    return _narrow(x, dim, start, length)


@NVFP4Tensor.implements(aten.select.int)
def _select(func, args, kwargs):
    x, dim, index = args
    sdim, is_block = x.storage_dim(dim)
    if is_block:
        raise ValueError(
            f"NVFP4Tensor cannot select along its block dim {dim} (shape {tuple(x.shape)}): "
            "that would split a 16-element block."
        )
    index = index + x.shape[dim] if index < 0 else index
    shape = [s for i, s in enumerate(x.shape) if i != normalize_dim(dim, x.dim())]
    # Selecting the tensor's last dim of a columnwise tensor leaves blocks along the new last dim.
    axis = ROWWISE if (x.axis == COLUMNWISE and sdim == x.qdata.dim() - 2) else x.axis
    return x.replace(
        shape=shape,
        qdata=x.qdata.select(sdim, index),
        scale=x.scale.select(sdim, index),
        amax=x.amax.select(sdim, index) if x.row_scaled else x.amax,
        axis=axis,
        spec=dataclasses.replace(x.spec, block_2d=x.block_2d and sdim != x.qdata.dim() - 2),
    )
