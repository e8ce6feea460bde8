"""FSDP2's all-gather hooks for every quantized tensor: the shards move as their bytes.

FSDP2 (`torch.distributed.fsdp.fully_shard`) calls `fsdp_pre_all_gather` on a sharded
parameter before its module runs and `fsdp_post_all_gather` on the gathered buffers. This module
gives QuantizedTensor both methods, written against the layout protocol only
(qtensor/tensors/layout.py), so every class with a layout shards the same way ([Note: quantized
FSDP2 shards] in qtensor/distributed/fsdp.py): the sharded leaves travel dim 0 first, so the
gathered tensor is their concatenation; replicated leaves (a per-tensor amax) ride in the
metadata; the full tensor is rebuilt around views of the gathered buffers. Nothing is
dequantized.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.layout import Leaf, Path, get_leaf, leaves, rebuild, shard_problem


@dataclasses.dataclass
class GatherMetadata:
    sharded: list[Leaf]  # in the order of the all-gather inputs
    replicated: dict[Path, torch.Tensor]
    shape: torch.Size  # the unsharded logical shape
    # One rank: FSDP2 copies only the first all-gather input (its world-size-1 shortcut), so
    # the sharded leaves travel packed in one uint8 buffer: (dtype, shape) per leaf, in order.
    packed: list[tuple[torch.dtype, torch.Size]] | None = None


def pre_all_gather(x: QuantizedTensor, mesh, outer_size, module: nn.Module | None):
    """(all-gather inputs, metadata): the sharded leaves, dim 0 first, contiguous."""
    world_size = mesh.size()
    problem = shard_problem(x, outer_size, world_size, param_name(module, x))
    if problem:  # every rank sees the same sizes, so every rank raises here together
        raise ValueError(problem)
    inputs, sharded, replicated = [], [], {}
    for leaf in leaves(x):
        t = get_leaf(x, leaf.path)
        if leaf.dim is None:
            replicated[leaf.path] = t
            continue
        inputs.append(t.movedim(leaf.dim, 0).contiguous())
        sharded.append(leaf)
    meta = GatherMetadata(sharded, replicated, torch.Size(outer_size))
    if world_size == 1 and len(inputs) > 1:
        # 4-byte leaves (a row-scaled amax) first, so every view back is aligned.
        order = sorted(range(len(inputs)), key=lambda i: -inputs[i].element_size())
        meta.sharded = [sharded[i] for i in order]
        meta.packed = [(inputs[i].dtype, inputs[i].shape) for i in order]
        inputs = [torch.cat([inputs[i].reshape(-1).view(torch.uint8) for i in order])]
    return tuple(inputs), meta


def post_all_gather(x: QuantizedTensor, outputs, meta: GatherMetadata, param_dtype, out=None):
    """The unsharded tensor around views of the gathered buffers (FSDP2 owns their memory)."""
    if meta.packed is not None:
        outputs = _unpack(outputs[0].view(-1), meta.packed)
    values = {leaf.path: o.movedim(0, leaf.dim) for leaf, o in zip(meta.sharded, outputs)}
    if out is not None:
        # FSDP2 re-gathers into the same buffers, so out's sharded leaves already hold the new
        # bytes; only replicated leaves (an amax that may have been requantized) are copied.
        for path, t in meta.replicated.items():
            dst = get_leaf(out, path)
            if dst is not t:
                dst.copy_(t)
        return None
    values.update(meta.replicated)
    full = rebuild(x, values, meta.shape, param_dtype or x.dtype)
    # No extra buffers to free on reshard: every leaf is a view of an all-gather output.
    return full, ()


def _unpack(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    views, offset = [], 0
    for dtype, shape in layout:
        n = shape.numel() * dtype.itemsize
        views.append(buffer[offset:offset + n].view(dtype).view(shape))
        offset += n
    return views


def param_name(module: nn.Module | None, local: torch.Tensor) -> str:
    """The parameter's name inside `module` (FSDP2 passes the owning module), for errors."""
    if module is None:
        return "a quantized parameter"
    from torch.distributed.fsdp import FSDPModule

    # fully_shard swaps the class for FSDP<Class>; name the user's class.
    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    for name, p in module.named_parameters(recurse=False):
        if getattr(p, "_local_tensor", p) is local:
            return f"{cls.__name__}.{name}"
    return f"a parameter of {cls.__name__}"


def _fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    return pre_all_gather(self, mesh, outer_size, module)


def _fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    return post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)


# FSDP2 looks these methods up on the parameter; every quantized class inherits them.
QuantizedTensor.fsdp_pre_all_gather = _fsdp_pre_all_gather
QuantizedTensor.fsdp_post_all_gather = _fsdp_post_all_gather
