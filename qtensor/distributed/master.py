"""FSDP2 training with the NVFP4 recipe: high-precision master shards, quantized all-gathers.

[Note: quantize before the all-gather]
A TrainingLinear's master weight stays high precision (fp32 or bf16) and sharded. Wrapped in a
`QuantizeOnGatherWeight`, it reaches FSDP2's all-gather as its forward operand instead:

1. once per step, `precompute_amaxes(model)` takes every wrapped weight's local amax and reduces
   them all in ONE all-reduce (MAX over a vector with one entry per weight), so each rank holds
   every weight's global amax;
2. `fsdp_pre_all_gather` quantizes the rank's shard with that global amax to the recipe's
   weight rowwise spec (NVFP4). The shard's bytes are the rows of what quantizing the whole
   weight gives, because blocks (1x16, or 16x16 tiles on 16-row-aligned shards) never span two
   shards and the amax is the whole weight's;
3. the all-gather moves those bytes ([Note: quantized FSDP2 shards] in fsdp.py): 0.5625 bytes
   per element, 0.28x bf16 and 0.14x an fp32 master;
4. `fsdp_post_all_gather` completes the operand the recipe needs for dgrad:
   - 2D tiles (`weight_2d`, the default): the columnwise NVFP4 bytes are the rowwise ones
     transposed (docs/formats.md, "Variants": 2D), rebuilt without requantizing;
   - `dgrad_mxfp8`: the MXFP8 columnwise weight is quantized from the gathered NVFP4 weight
     dequantized to the master dtype, exactly as the recipe defines it;
   - 1x16 NVFP4 dgrad (no 2D tiles): the columnwise side cannot be derived, so each rank also
     quantizes it from its shard (blocks along dim 0, 16-row-aligned) and both sides move.
   The TrainingLinear sees a quantized parameter and uses it as its operand; dW comes back in
   the master dtype and FSDP2 reduce-scatters it into the master shard's gradient.

`backward_override="high_precision"` needs the high-precision weight in the backward, so those
layers keep FSDP2's ordinary high-precision all-gather (quantize_on_gather refuses them).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from qtensor.tensors import gather, layout
from qtensor.formats.elements import pack_fp4, unpack_fp4
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.hybrid import HybridTensor, quantize_spec
from qtensor.tensors.nvfp4 import NVFP4Tensor
from qtensor.tensors.common import COLUMNWISE

aten = torch.ops.aten
# Ops whose results are still the master weight (FSDP2's sharding and the optimizer's copies).
_PRESERVE = {
    aten.detach, aten.alias, aten.clone, aten._to_copy, aten.empty_like, aten.new_zeros,
    aten.slice, aten.split, aten.split_with_sizes, aten.view, aten._unsafe_view, aten.as_strided,
    aten.copy_,
}


class QuantizeOnGatherWeight(torch.Tensor):
    """A high-precision master weight that FSDP2 all-gathers as its quantized forward operand.

    Every op runs on the wrapped tensor (`_data`); `role` is the recipe's weight RoleSpec and
    `amax` the whole weight's amax, set by `precompute_amaxes` ([Note: quantize before the
    all-gather]).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, role):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, role):
        self._data, self.role = data, role
        self.amax: torch.Tensor | None = None
        # (version counter holder, its version) when the amax was taken: the sharded DTensor
        # parameter, whose counter the optimizer's in-place updates bump (the wrapped tensor's
        # does not: those updates reach it below autograd).
        self._amax_stamp: tuple[torch.Tensor, int] | None = None

    def __repr__(self):
        return f"QuantizeOnGatherWeight({self._data!r}, rowwise={self.role.rowwise})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        role = next(a.role for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable and args and isinstance(args[0], cls):
            return args[0]  # in place (optimizer steps, FSDP2's copy_ into its padded shard)
        if func.overloadpacket in _PRESERVE:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, role), out)
        return out

    # ---- FSDP2 all-gather hooks ---------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        stamp = self._amax_stamp
        if self.amax is None or stamp is None or stamp[0]._version != stamp[1]:
            raise RuntimeError(
                f"The global amax of {gather.param_name(module, self)} is "
                f"{'missing' if self.amax is None else 'stale (the weight changed since)'}. "
                "Call qtensor.distributed.precompute_amaxes(model) before the first forward "
                "and after every optimizer step (one all-reduce for all weights)."
            )
        operand = shard_operand(self._data, self.role, self.amax)
        inputs, meta = gather.pre_all_gather(operand, mesh, outer_size, module)
        return inputs, (operand, meta)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        operand, meta = metadata
        gathered = gather.post_all_gather(operand, all_gather_outputs, meta, param_dtype)[0]
        full = complete_operand(gathered, self.role, self._data.dtype)
        if out is None:
            # The derived columnwise bytes are FSDP2's to free on reshard and refill here.
            return full, tuple(_derived_leaves(full, gathered))
        for leaf in layout.leaves(full):  # gathered leaves are already out's (same buffers)
            src, dst = layout.get_leaf(full, leaf.path), layout.get_leaf(out, leaf.path)
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        return None


def shard_operand(shard: torch.Tensor, role, amax: torch.Tensor) -> QuantizedTensor:
    """What a rank all-gathers: its shard quantized with the whole weight's amax."""
    spec = role.rowwise
    if not isinstance(spec, NVFP4Spec):
        raise TypeError(f"quantize-before-all-gather takes an NVFP4 weight spec; got {spec}.")
    row = NVFP4Tensor.from_spec(shard, spec, check_finite=False, global_amax=amax)
    if role.columnwise is None or _derived_after_gather(role):
        return row
    col = NVFP4Tensor.from_spec(shard, role.columnwise, check_finite=False, global_amax=amax)
    return HybridTensor(shard.shape, shard.dtype, shard.device, rowwise=row, columnwise=col,
                        columnwise_source=role.columnwise_source)


def _derived_after_gather(role) -> bool:
    """Whether the columnwise side is built from the gathered rowwise side (not gathered)."""
    if role.columnwise_source == "rowwise_dequantized":
        return True
    col = role.columnwise
    return (isinstance(col, NVFP4Spec) and col.block_2d and not col.rht and col.fourover6 is None
            and dataclasses.replace(col, columnwise=False) == role.rowwise)


def complete_operand(gathered: QuantizedTensor, role, master_dtype) -> QuantizedTensor:
    """The full weight operand of the role from what was gathered."""
    if role.columnwise is None or gathered.parts():
        return gathered
    if role.columnwise_source == "rowwise_dequantized":
        col = quantize_spec(gathered.dequantize(master_dtype), role.columnwise,
                            check_finite=False)
    else:
        col = columnwise_from_2d(gathered)
    return HybridTensor(gathered.shape, gathered.dtype, gathered.device, rowwise=gathered,
                        columnwise=col, columnwise_source=role.columnwise_source)


def columnwise_from_2d(row: NVFP4Tensor) -> NVFP4Tensor:
    """The columnwise bytes of a 16x16-tiled rowwise NVFP4 matrix [N, K]: codes transposed;
    tile (j, t)'s scale, stored on each of its rows, becomes storage [K, N/16] (docs/formats.md,
    "Variants": 2D). The result is the tensor quantizing the matrix columnwise gives, its spec
    included."""
    codes = unpack_fp4(row.qdata)  # [N, K]
    qdata = pack_fp4(codes.t().contiguous())  # [K, N/2]
    scale = row.scale[::16].t().repeat_interleave(16, dim=0).contiguous()  # [K, N/16]
    return row.replace(qdata=qdata, scale=scale, axis=COLUMNWISE,
                       spec=dataclasses.replace(row.spec, columnwise=True))


def _derived_leaves(full: QuantizedTensor, gathered: QuantizedTensor) -> list[torch.Tensor]:
    """Leaves of `full` built after the gather (not views of FSDP2's buffers, not the amax)."""
    if full is gathered:
        return []
    side = full.columnwise
    return [getattr(side, n) for n in ("qdata", "scale")]


# ---- model-level entry points -----------------------------------------------------------------


def quantize_on_gather(model: nn.Module) -> nn.Module:
    """Wrap every TrainingLinear's master weight so FSDP2 gathers it quantized. Call before
    fully_shard and before building the optimizer (the Parameters are replaced)."""
    from qtensor.training import TrainingLinear

    for name, module in model.named_modules():
        if not isinstance(module, TrainingLinear):
            continue
        specs = module.state.specs
        if specs.backward_override == "high_precision":
            raise ValueError(
                f"{name}: backward_override='high_precision' multiplies the high-precision "
                "weight in the backward, so it cannot be gathered quantized. Leave this layer "
                "to FSDP2's ordinary all-gather (skip quantize_on_gather for it)."
            )
        w = module.weight
        module.weight = nn.Parameter(QuantizeOnGatherWeight(w.detach(), specs.weight),
                                     requires_grad=w.requires_grad)
    return model


def precompute_amaxes(model: nn.Module) -> torch.Tensor:
    """Every wrapped weight's global amax, in one all-reduce; returns the vector of them."""
    shards = [p for p in model.parameters()
              if isinstance(getattr(p, "_local_tensor", None), QuantizeOnGatherWeight)]
    if not shards:
        raise ValueError("precompute_amaxes found no sharded QuantizeOnGatherWeight parameter; "
                         "call quantize_on_gather(model) and fully_shard first.")
    meshes = {p.device_mesh for p in shards}
    if len(meshes) != 1:
        raise ValueError(f"precompute_amaxes reduces over one mesh; the weights use {len(meshes)}.")
    local = [p._local_tensor for p in shards]
    with torch.no_grad():
        amaxes = torch.stack([t._data.abs().amax().float() for t in local])
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=shards[0].device_mesh.get_group())
    for i, (p, t) in enumerate(zip(shards, local)):
        t.amax, t._amax_stamp = amaxes[i], (p, p._version)
    return amaxes
