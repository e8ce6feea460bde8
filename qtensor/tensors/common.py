"""Ops every quantized tensor class shares: detach, clone, to/_to_copy, copy_, and input checks."""

from __future__ import annotations

import dataclasses

import torch

from qtensor.tensors.base import QuantizedTensor

aten = torch.ops.aten

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bytes_spec(spec):
    """The spec a tensor stores: the one it was quantized with, less stochastic rounding, which
    is how the codes were rounded, not part of what they mean (a tensor rounded stochastically
    and one rounded to nearest hold bytes of one format and copy into each other)."""
    if not getattr(spec, "stochastic_rounding", False):
        return spec
    if torch.compiler.is_compiling():
        return dataclasses.replace(spec, stochastic_rounding=False)
    # Eagerly kept per spec (specs are frozen): a replace per quantized gradient costs
    # microseconds of the training step's host time.
    out = _BYTES_SPECS.get(spec)
    if out is None:
        out = _BYTES_SPECS[spec] = dataclasses.replace(spec, stochastic_rounding=False)
    return out


_BYTES_SPECS: dict = {}


def check_hp_input(x: torch.Tensor, fmt: str) -> None:
    """Validate a high-precision tensor before quantization, naming the rule broken."""
    if isinstance(x, QuantizedTensor):
        raise TypeError(f"{fmt} quantizes a high-precision tensor; got {type(x).__name__}.")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{fmt} quantizes float32, bfloat16 or float16 tensors; got {x.dtype}. "
            "Convert with .to(torch.bfloat16) first."
        )
    if x.numel() == 0:
        raise ValueError(f"{fmt} needs a non-empty tensor; got shape {tuple(x.shape)}.")


class NonFiniteInputError(ValueError):
    """A tensor to quantize holds NaN or Inf (`count` of them) and check_finite is on."""

    def __init__(self, message: str, count: int):
        super().__init__(message)
        self.count = count


def require_finite(x: torch.Tensor, fmt: str, quantized) -> None:
    """Raise the documented error if x holds a NaN or an Inf.

    The evidence is what the quantization computed anyway (`quantized.input_was_finite()`): an
    amax that is not finite (NVFP4: the amax is torch.amax, so any NaN or Inf input reaches
    it) or a 0xFF block scale (MXFP8: non-finite blocks get code 255). Reading it is the one
    device sync, done after everything else was issued; x is read again, to count, only when
    it says no (an RHT can also overflow a finite input to Inf: then the count is 0 and
    nothing is raised). Compiled and fake tensors are not checked: a check would be a graph
    break.
    """
    if torch.compiler.is_compiling() or _is_fake(x) or quantized.input_was_finite():
        return
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise NonFiniteInputError(
            f"{fmt} input has {bad} non-finite value(s) (NaN or Inf) in a tensor of shape "
            f"{tuple(x.shape)}. Fix the producer of this tensor, or pass "
            "check_finite=False to get the documented hardware rule (docs/formats.md).", bad)


def _is_fake(x: torch.Tensor) -> bool:
    return isinstance(x, torch._subclasses.fake_tensor.FakeTensor) or x.device.type == "meta"


@QuantizedTensor.implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    return args[0].map_data(func)


@QuantizedTensor.implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0].map_data(lambda t: t.clone(memory_format=torch.contiguous_format))


@QuantizedTensor.implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    """`.to(device)` moves the bytes; `.to(dtype)` changes the dtype products are returned in."""
    x = args[0]
    dtype = kwargs.get("dtype") or x.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{type(x).__name__}.to(dtype) sets the output dtype of its products and takes "
            f"float32, bfloat16 or float16; got {dtype}."
        )
    device = kwargs.get("device") or x.device
    return x.map_data(lambda t: _move(t, device, dtype), dtype=dtype,
                      **_backend_for_device(x, device))


def _backend_for_device(x, device) -> dict:
    """The GEMM backend belongs to the device: chosen again when the bytes change device."""
    if "gemm_backend" in x.tensor_attribute_names and torch.device(device).type != x.device.type:
        return {"gemm_backend": type(x).gemm_backend_for(device)}
    return {}


def _move(t: torch.Tensor, device, dtype) -> torch.Tensor:
    # A nested quantized tensor (a HybridTensor's side) takes the same _to_copy; `.to()` on it
    # would reach its op table as aten.to.dtype_layout, which no table implements.
    if isinstance(t, QuantizedTensor):
        return aten._to_copy.default(t, dtype=dtype, device=device)
    return t.to(device=device, copy=True)


@QuantizedTensor.implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    """Uninitialized bytes of the same layout and metadata (Module.to_empty from a meta model,
    then load a checkpoint). A dtype change is refused: it would change the products' dtype."""
    x = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != x.dtype:
        raise TypeError(
            f"empty_like of a {type(x).__name__} keeps its dtype {x.dtype}; got dtype={dtype}. "
            "Quantize a tensor of that dtype instead."
        )
    device = kwargs.get("device") or x.device
    return x.map_data(lambda t: _empty(t, device), **_backend_for_device(x, device))


def _empty(t: torch.Tensor, device) -> torch.Tensor:
    if isinstance(t, QuantizedTensor):  # a HybridTensor's side
        return aten.empty_like.default(t, device=device)
    return torch.empty_like(t, device=device)


@QuantizedTensor.implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if type(src) is not type(dst):
        raise TypeError(
            f"copy_ into a {type(dst).__name__} needs a {type(dst).__name__} source; got "
            f"{type(src).__name__}. Quantize the source first (it is never requantized "
            "implicitly)."
        )
    differ = metadata_mismatch(dst, src)
    if src.shape != dst.shape or differ:
        raise ValueError(
            f"copy_ needs the same shape and metadata; they differ in "
            f"{differ or ['shape']} (destination {dst!r}, source {src!r}). Quantize the source "
            "with the destination's config, or load with assign=True to take the source's format."
        )
    for name in dst.tensor_data_names:
        d, s = getattr(dst, name), getattr(src, name)
        if (d is None) != (s is None):
            raise ValueError(f"copy_: inner tensor {name!r} is present on one side only.")
        if d is not None:
            d.copy_(s)
    return dst


# Which code produced or multiplies the bytes: never part of what the bytes mean.
INFORMATIONAL_ATTRIBUTES = ("quant_backend", "gemm_backend")


def metadata_mismatch(dst: QuantizedTensor, src: QuantizedTensor) -> list[str]:
    """The attributes (informational ones aside) whose values differ, a spec field by field,
    e.g. ['spec.e4m3_bound: 448 != 256']; [] when the two tensors mean their bytes the same
    way."""
    out = []
    for n in dst.tensor_attribute_names:
        a, b = getattr(dst, n), getattr(src, n)
        if n in INFORMATIONAL_ATTRIBUTES or a == b:
            continue
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            # A spec's `columnwise` says which way the tensor was quantized, not what its bytes
            # mean: the direction of the bytes is `axis`, compared as its own attribute (the
            # transpose of a rowwise quantization of x.t() holds the bytes of x's columnwise
            # one).
            skip = ("columnwise",) if n == "spec" else ()
            out += [f"{n}.{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
                    for f in dataclasses.fields(a)
                    if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)]
        else:
            out.append(f"{n}: {a!r} != {b!r}")
    return out


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def block_dim_size(shape, axis: str, block: int) -> int:
    """The size of the dim a tensor of logical `shape` runs its `block`-element blocks along
    (the last dim rowwise, dim -2 columnwise); ValueError when it cannot hold them (the
    checkpoint reader's shape rule)."""
    col = axis == COLUMNWISE
    if not shape or (col and len(shape) < 2) or (shape[-2] if col else shape[-1]) % block:
        raise ValueError(f"{list(shape)} cannot hold {axis} {block}-element blocks.")
    return shape[-2] if col else shape[-1]


def transposed_storage_dim(axis: str, ndim: int, dim: int) -> tuple[int, bool]:
    """(storage dim, is block dim) of logical `dim` for a format that stores a columnwise tensor
    as its transpose (NVFP4, MXFP4: packed codes along the storage's last dim)."""
    dim = normalize_dim(dim, ndim)
    if axis == ROWWISE:
        return dim, dim == ndim - 1
    if dim == ndim - 2:
        return ndim - 1, True
    return (ndim - 2 if dim == ndim - 1 else dim), False


def infer_shape(shape, numel: int) -> torch.Size:
    """Resolve one -1 in a view shape."""
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = numel // known if known else 0
    return torch.Size(shape)


def slice_bounds(x, dim=0, start=None, end=None, step=1):
    """(x, dim, start, length) of aten.slice.Tensor's arguments, clamped like Python slicing."""
    if step != 1:
        raise ValueError(f"{type(x).__name__} slices with step 1 only; got step {step}.")
    dim = normalize_dim(dim, x.dim())
    size = x.shape[dim]
    start = 0 if start is None else max(0, min(size, start + size if start < 0 else start))
    end = size if end is None else max(start, min(size, end + size if end < 0 else end))
    return x, dim, start, end - start


@QuantizedTensor.implements(aten.split.Tensor)
def _split(func, args, kwargs):
    x, size = args[0], args[1]
    dim = normalize_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), x.dim())
    return [
        aten.slice.Tensor(x, dim, s, min(s + size, x.shape[dim]))
        for s in range(0, x.shape[dim], size)
    ]


@QuantizedTensor.implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    x, sizes = args[0], args[1]
    dim = normalize_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), x.dim())
    out, start = [], 0
    for s in sizes:
        out.append(aten.slice.Tensor(x, dim, start, start + s))
        start += s
    return out


@QuantizedTensor.implements(aten.expand.default)
def _expand(func, args, kwargs):
    """Only the identity expand, which torch.matmul's decomposition of N-D products emits."""
    x, size = args[0], list(args[1])
    want = [s if n == -1 else n for n, s in zip(size, x.shape)] if len(size) == x.dim() else size
    if torch.Size(want) != x.shape:
        raise ValueError(
            f"{type(x).__name__} cannot be broadcast (expand {tuple(x.shape)} -> {tuple(size)}): "
            "its blocks and scales would be repeated. Give both matmul operands the same batch "
            "dims."
        )
    return x.replace()


def flips_last_two(x, func, args) -> bool:
    """Whether aten.t / aten.transpose.int on x swaps its last two dims (False: a no-op).

    Quantized tensors transpose only there: that is the rowwise/columnwise flip.
    """
    if x.dim() < 2:
        return False
    dims = (0, 1) if func is aten.t.default else args[1:3]
    dims = sorted(normalize_dim(d, x.dim()) for d in dims)
    if dims[0] == dims[1]:
        return False
    if dims != [x.dim() - 2, x.dim() - 1]:
        raise ValueError(
            f"{type(x).__name__} transposes only its last two dims (a rowwise/columnwise flip); "
            f"got dims {tuple(args[1:3])} for shape {tuple(x.shape)}."
        )
    return True
