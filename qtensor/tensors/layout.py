"""What the rest of the package asks a quantized tensor about its storage, answered from the
layout protocol each class declares (QuantizedTensor, [Note: layout protocol]).

FSDP2 sharding, tensor parallelism, checkpoints and the GEMM layer never test a tensor's class:
they walk its *leaves* (the plain inner tensors, a composite's parts included) and ask the class
where its dim 0 lives in storage, how many elements one scale covers along a dim, and whether it
has a 1-D reading. This module derives, from those answers alone:

- `leaves` / `get_leaf` / `rebuild`: the plain inner tensors of any quantized tensor, and the
  tensor of the same class and metadata around new ones;
- `shard_problem`: whether a tensor splits into equal dim-0 shards that keep its blocks whole
  ([Note: quantized FSDP2 shards] in qtensor/distributed/fsdp.py);
- the three aten ops FSDP2 calls on a parameter that no class table had: `new_zeros` (resized
  along dim 0), `as_strided` (the identity only) and `view(-1)` (`flat_view`, the real
  flattening where the class has one, else a `QuantizedStorageView` that refuses every op, so
  nothing decodes bytes in an order they were not written in).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import ROWWISE, infer_shape, slice_bounds

aten = torch.ops.aten
Path = tuple[str, ...]  # ("rowwise", "qdata"): attribute names from the outer tensor to a leaf


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: Path
    dim: int | None  # storage dim carrying the tensor's dim 0; None: replicated


def leaves(x: QuantizedTensor, prefix: Path = ()) -> list[Leaf]:
    """Every plain inner tensor of x (a composite's parts walked in order), with its dim-0 dim."""
    parts = x.parts()
    if parts:
        return [leaf for name, part in parts.items() for leaf in leaves(part, prefix + (name,))]
    return [Leaf(prefix + (name,), dim) for name, dim in x.shard_dims().items()]


def get_leaf(x: QuantizedTensor, path: Path) -> torch.Tensor:
    for name in path:
        x = getattr(x, name)
    return x


def rebuild(x: QuantizedTensor, values: dict[Path, torch.Tensor], shape, dtype, prefix: Path = ()):
    """x's class and metadata around new leaves (every leaf of x must be in `values`)."""
    parts = x.parts()
    if parts:
        sides = {n: rebuild(p, values, shape, dtype, prefix + (n,)) for n, p in parts.items()}
        return x.replace(shape=shape, dtype=dtype, **sides)
    return x.replace(shape=shape, dtype=dtype,
                     **{n: values[prefix + (n,)] for n in x.tensor_data_names})


def map_parts(x: QuantizedTensor, fn: Callable[[QuantizedTensor], QuantizedTensor]):
    """fn applied to each single-format tensor inside x (x itself when it has no parts)."""
    parts = x.parts()
    if not parts:
        return fn(x)
    return x.replace(**{n: map_parts(p, fn) for n, p in parts.items()})


def shard_problem(x: QuantizedTensor, shape, world_size: int, name: str) -> str | None:
    """Why a quantized tensor of the full `shape` (x's metadata) cannot be split into
    `world_size` dim-0 shards, or None."""
    label = f"{name} ({type(x).__name__}, shape {tuple(shape)})"
    try:
        leaves(x)  # a class that cannot be sharded at all says why in shard_dims
    except NotImplementedError as e:
        return f"{label}: {e}"
    unit, rows = x.block_size(0), shape[0]
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
    device=), replicated ones by like(leaf)."""
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
                f"multiple of {x.block_size(0)}."
            )
        shape = list(t.shape)
        shape[leaf.dim] = size // x.shape[0]
        values[leaf.path] = new(shape, dtype=t.dtype, device=t.device)
    return rebuild(x, values, (rows, *x.shape[1:]), x.dtype)


# ---- the ops FSDP2 and DTensor call on a quantized parameter -------------------------------------
#
# `fully_shard` turns a parameter into its dim-0 shard with, in order: `torch.chunk` (aten.split,
# in the shared op table), `new_zeros` of the padded shard size, `narrow(...).copy_(shard)`,
# `view(-1)` (kept as FSDP's flat `_sharded_param_data`, used only by parameters without
# all-gather hooks) and, after the all-gather, `torch.as_strided(full, size, contiguous strides)`.


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


@QuantizedTensor.implements(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    """Zeros of the same class and metadata (codes 0 decode to 0 whatever the scale), resized
    along dim 0 only."""
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


def trivial_view(x: QuantizedTensor, shape: torch.Size):
    """The views every class takes the same way, or None: the identity (a view op returns a new
    tensor even then) and `view(-1)`, as FSDP2 takes of every parameter (`flat_view`)."""
    if shape == x.shape:
        return x.replace()
    if len(shape) == 1 and x.dim() > 1:
        return flat_view(x)
    return None


def view_op(func, args, kwargs):
    """aten.view / _unsafe_view / reshape of every single-format class: the trivial views, or
    new leading dims on a rowwise tensor whose blocks run along the last dim alone
    (`block_size` is 1 on every other dim) and that keeps that dim. Each inner tensor's leading
    dims follow: [*lead, C] data and scales, a [*lead] per-row amax; a per-tensor amax stays."""
    x, shape = args[0], infer_shape(args[1], args[0].numel())
    same = trivial_view(x, shape)
    if same is not None:
        return same
    nd = x.dim()
    last_only = x.axis == ROWWISE and all(x.block_size(d) == 1 for d in range(nd - 1))
    if not last_only or len(shape) == 0 or shape[-1] != x.shape[-1]:
        raise ValueError(
            f"{type(x).__name__} can be reshaped only when it is rowwise, with its blocks along "
            f"the last dim alone, and keeps its last dim (blocks stay intact); got "
            f"{tuple(x.shape)} -> {tuple(shape)} with {x!r}.")
    lead = tuple(shape[:-1])

    def follow(t):
        if t is None or t.dim() == 0:
            return t
        return t.reshape(*lead, t.shape[-1]) if t.dim() == nd else t.reshape(lead)

    return x.replace(shape=shape, **{n: follow(getattr(x, n)) for n in x.tensor_data_names})


def slice_op(func, args, kwargs):
    """aten.slice of a class whose inner tensors are codes and one scale per block (MXFP8,
    MXFP4, FP8 block): any range along a dim no block runs along, whole blocks along a block
    dim. The codes narrow by their elements per byte along that dim (2 for packed 4-bit codes),
    read from the shapes."""
    x, dim, start, length = slice_bounds(*args)
    sdim, _ = x.storage_dim(dim)
    unit = x.block_size(dim)
    if start % unit or length % unit:
        raise ValueError(
            f"{type(x).__name__} slices along a block dim only at multiples of {unit}; got start "
            f"{start}, length {length} on dim {dim} of {tuple(x.shape)}.")
    stored = x.qdata.shape[sdim]
    per = x.shape[dim] // stored if stored else 1
    shape = list(x.shape)
    shape[dim] = length
    return x.replace(shape=shape, qdata=x.qdata.narrow(sdim, start // per, length // per),
                     scale=x.scale.narrow(sdim, start // unit, length // unit))


def flat_view(x: QuantizedTensor):
    """`x.view(-1)`: the class's 1-D reading where its blocks stay whole, else a
    QuantizedStorageView."""
    flat = x.flat()
    return flat if flat is not None else QuantizedStorageView(x)


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
