"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for quantized parameters.

[Note: quantized FSDP2 shards]
FSDP2 splits each parameter along dim 0 into one equal chunk per rank and, before a module
runs, all-gathers the chunks. A quantized parameter stays quantized on both sides of that:

- *leaves*: the plain inner tensors of a quantized tensor (codes, block scales, a row-scaled
  amax), the two sides of a HybridTensor included. A leaf is either *sharded* along the storage
  dim that carries the tensor's dim 0, or *replicated* (a per-tensor amax; the per-column amax
  of a columnwise row-scaled tensor, which spans all rows), and then every rank holds all of it.
- where dim 0 lives in storage: rowwise NVFP4 and every MXFP8 keep it as storage dim 0 (codes
  [R, C/2], scales [R, C/16] or [R/32, C]); columnwise NVFP4 stores the transpose, so dim 0
  is the packed last storage dim ([C, R/2], [C, R/16]).
- shards follow blocks: a shard's row count must be a multiple of the rows one scale covers
  along dim 0: 16 for NVFP4 16x16 tiles and columnwise NVFP4, 32 for columnwise MXFP8, else 1.
  Dim 0 must split evenly: FSDP2 pads an uneven last shard to the others' size, and padding
  would have to be done inside codes and scales; such a parameter is refused with its name.
- the all-gather: `fsdp_pre_all_gather` hands FSDP2 the sharded leaves (dim 0 first, so the
  gathered tensor is the concatenation), FSDP2 moves them as bytes (it views mixed dtypes as
  uint8), and `fsdp_post_all_gather` rebuilds the full tensor around views of the gathered
  buffers, with the replicated leaves passed on in the metadata. Nothing is dequantized: a
  rowwise NVFP4 weight moves 0.5625 bytes per element (codes 0.5 + scales 0.0625), 0.28x bf16.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import nn

from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import ROWWISE
from qtensor.tensors.hybrid import HybridTensor
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor

Path = tuple[str, ...]  # ("rowwise", "qdata"): attribute names from the outer tensor to a leaf


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: Path
    dim: int | None  # storage dim carrying the tensor's dim 0; None: replicated


def leaf_dims(x: QuantizedTensor) -> dict[str, int | None]:
    """For a single-format tensor: inner tensor name -> storage dim of dim 0 (None: replicated)."""
    if isinstance(x, NVFP4Tensor):
        sdim, _ = x.storage_dim(0)
        # Row-scaled amax has the storage shape minus its last dim: rowwise [*lead, R] follows
        # dim 0; columnwise [C] holds one amax per column over all rows, so every shard needs it.
        amax = sdim if (x.row_scaled and x.axis == ROWWISE) else None
        return {"qdata": sdim, "scale": sdim, "amax": amax}
    if isinstance(x, MXFP8Tensor):
        return {"qdata": 0, "scale": 0}  # both keep the logical layout (scale [R/32, C] too)
    raise NotImplementedError(
        f"qtensor's FSDP2 sharding rules cover NVFP4Tensor, MXFP8Tensor and HybridTensor; got "
        f"{type(x).__name__}. Keep this parameter out of fully_shard (ignored_params)."
    )


def leaves(x: QuantizedTensor, prefix: Path = ()) -> list[Leaf]:
    if isinstance(x, HybridTensor):
        return leaves(x.rowwise, prefix + ("rowwise",)) + leaves(
            x.columnwise, prefix + ("columnwise",)
        )
    return [Leaf(prefix + (name,), dim) for name, dim in leaf_dims(x).items()]


def get_leaf(x: QuantizedTensor, path: Path) -> torch.Tensor:
    for name in path:
        x = getattr(x, name)
    return x


def rebuild(x: QuantizedTensor, values: dict[Path, torch.Tensor], shape, dtype, prefix: Path = ()):
    """x's class and metadata around new leaves (every leaf of x must be in `values`)."""
    if isinstance(x, HybridTensor):
        sides = {s: rebuild(getattr(x, s), values, shape, dtype, prefix + (s,))
                 for s in ("rowwise", "columnwise")}
        return x.replace(shape=shape, dtype=dtype, **sides)
    return x.replace(shape=shape, dtype=dtype,
                     **{n: values[prefix + (n,)] for n in x.tensor_data_names})


def shard_multiple(x: QuantizedTensor) -> int:
    """Rows one scale covers along dim 0: each shard's dim 0 must be a multiple of it."""
    if isinstance(x, HybridTensor):
        return math.lcm(shard_multiple(x.rowwise), shard_multiple(x.columnwise))
    if isinstance(x, NVFP4Tensor):
        _, is_block = x.storage_dim(0)
        return 16 if is_block or (x.block_2d and x.dim() == 2) else 1
    if isinstance(x, MXFP8Tensor):
        return 32 if x.block_dim() == 0 else 1
    leaf_dims(x)  # raises for other classes
    return 1


def shard_problem(x: QuantizedTensor, shape, world_size: int, name: str) -> str | None:
    """Why a quantized tensor of the full `shape` (x's metadata) cannot be split into
    `world_size` dim-0 shards, or None."""
    unit, rows = shard_multiple(x), shape[0]
    label = f"{name} ({type(x).__name__}, shape {tuple(shape)})"
    remedy = (
        f"Give it a dim 0 divisible by {world_size * unit}, or keep it out of fully_shard "
        "(ignored_params)."
    )
    if rows % world_size:
        return (
            f"{label}: FSDP2 would shard its dim 0 of {rows} unevenly over {world_size} "
            f"ranks; quantized parameters need equal "
            f"shards (FSDP2 pads the last shard, and codes and scales cannot be padded). {remedy}"
        )
    if (rows // world_size) % unit:
        return (
            f"{label}: {world_size} shards of {rows // world_size} rows would cut its "
            f"{unit}-row scale blocks; each shard needs "
            f"a multiple of {unit} rows. {remedy}"
        )
    return None


def rows_resized(x: QuantizedTensor, rows: int, like: Callable, new: Callable):
    """x's class and metadata with dim 0 of `rows`: sharded leaves made by new(shape, dtype=,
    device=), replicated ones by like(leaf). Used by new_zeros (qtensor/distributed/ops.py)."""
    values = {}
    for leaf in leaves(x):
        t = get_leaf(x, leaf.path)
        if leaf.dim is None:
            values[leaf.path] = like(t)
            continue
        size = t.shape[leaf.dim] * rows
        if size % x.shape[0]:
            raise ValueError(
                f"{type(x).__name__} of shape {tuple(x.shape)} cannot be resized to {rows} rows: "
                f"its {'.'.join(leaf.path)} would need {size / x.shape[0]} rows; use a "
                f"multiple of {shard_multiple(x)}."
            )
        shape = list(t.shape)
        shape[leaf.dim] = size // x.shape[0]
        values[leaf.path] = new(shape, dtype=t.dtype, device=t.device)
    return rebuild(x, values, (rows, *x.shape[1:]), x.dtype)


# ---- the all-gather hooks (called through QuantizedTensor.fsdp_pre/post_all_gather) ----------


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
    problem = shard_problem(x, outer_size, world_size, _param_name(module, x))
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


def _param_name(module: nn.Module | None, local: torch.Tensor) -> str:
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


# ---- fully_shard with the checks up front ----------------------------------------------------


def shard_problems(model: nn.Module, world_size: int) -> list[str]:
    """Every quantized parameter of `model` that cannot be dim-0 sharded over world_size."""
    problems = []
    for name, p in model.named_parameters():
        if isinstance(p, QuantizedTensor):
            why = shard_problem(p, p.shape, world_size, name)
            if why:
                problems.append(why)
    return problems


def fully_shard(module: nn.Module, **kwargs):
    """`torch.distributed.fsdp.fully_shard` after checking every quantized parameter's shards.

    Same arguments. The check names each parameter that would be cut mid-block or sharded
    unevenly (torch's own fully_shard finds out only at the first all-gather).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = kwargs.get("mesh")
    if mesh is None:
        device = next((p.device.type for p in module.parameters()), "cpu")
        mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
        kwargs["mesh"] = mesh
    if "shard_placement_fn" in kwargs and kwargs["shard_placement_fn"] is not None:
        raise ValueError(
            "qtensor's fully_shard shards quantized parameters along dim 0 only (blocks run "
            "along the last dim); drop shard_placement_fn or shard this module with torch's "
            "fully_shard and keep quantized parameters out of it."
        )
    problems = shard_problems(module, mesh.size(-1))
    if problems:
        raise ValueError("Cannot fully_shard this module:\n  " + "\n  ".join(problems))
    return torch_fully_shard(module, **kwargs)
