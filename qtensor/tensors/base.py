"""QuantizedTensor: the plumbing every quantized tensor class shares, declared once.

[Note: quantized tensors]
A quantized tensor is a wrapper subclass whose outer shape and dtype are the high-precision
tensor it stands for (the dtype is also the dtype its products are returned in). The bytes live
in inner tensors named by `tensor_data_names`; the decode metadata lives in plain attributes
named by `tensor_attribute_names`. Flatten/unflatten, repr, `replace` and pickling are derived
from those two tuples. Every aten op goes through the class's op table: an op that is not in
it raises NotImplementedError naming the op and the argument types. Nothing dequantizes
behind the user's back.

[Note: layout protocol]
Each class also says how it is stored, so that sharding (FSDP2, tensor parallelism),
checkpoints and the GEMM layer ask the class instead of testing which class it is:
- `parts()`: the quantized inner tensors of a composite (a HybridTensor's sides), walked by
  everything below as a tree whose leaves are plain tensors;
- `shard_dims()`: per plain inner tensor, the storage dim carrying the logical dim 0 (None:
  replicated, such as a per-tensor amax);
- `block_size(dim)`: elements one scale covers along a logical dim;
- `flat()`: the 1-D reading `view(-1)` returns, where there is one;
- `inner_layout(shape, attrs)`: the inner shapes and dtypes the class derives from its logical
  shape and attributes (a checkpoint must hold exactly these);
- `gemm_operand(side)`, `gemm_format`, `gemm_rows(...)`, `pair_problem(other)`: how it enters
  a product (qtensor/gemm/dense.py);
- `spec`: the format spec it was quantized with, as a value;
- `stored()`: the tensor as checkpoints hold it (itself, but for a serving layout such as
  DecodeWeight, which gives its canonical tensor).
qtensor/tensors/layout.py derives leaves, rebuilding, shard checks and the FSDP2 storage ops from
these; a new format implements them once in its class.

[Note: spec on the tensor]
A single-format tensor stores the spec it was quantized with as one attribute, `spec`, next to
`axis`: `spec` says how the bytes were made (block_2d, row_scaled, 4over6, E4M3 bound, RHT; its
`columnwise` is the direction at quantization), `axis` says which way the blocks run in this
view (a transpose flips `axis` and keeps `spec`). Stochastic rounding is not kept: it is how
the codes were rounded, not what they mean. The fields the layout reads are also attributes of
the tensor (`t.block_2d` is `t.spec.block_2d`). Checkpoints store the spec as one value; their
reader takes the unpacked attributes of version 1 files too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import torch
from torch.utils._pytree import tree_map

from qtensor.backends import resolve_gemm_backend

OpHandler = Callable[..., Any]
_GEMM_AXIS = {"left": "rowwise", "right": "columnwise"}


class QuantizedTensor(torch.Tensor):
    tensor_data_names: ClassVar[tuple[str, ...]] = ()
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ()
    # Filled per subclass by `implements`; a subclass sees its own ops and then the base's.
    _op_table: ClassVar[dict[Any, OpHandler]] = {}
    # Every concrete class by name (the fixed table checkpoints read class names through).
    classes: ClassVar[dict[str, type["QuantizedTensor"]]] = {}
    # The format name the GEMM ops take for this class ("nvfp4", "mxfp8"); None for a composite,
    # whose parts enter products instead.
    gemm_format: ClassVar[str | None] = None
    # The spec dataclass a single-format class stores as its `spec` attribute.
    spec_type: ClassVar[type | None] = None
    # The attributes the class stored before its spec moved onto it (version 1 checkpoints,
    # earlier pickles); `upgrade_attributes` turns them into today's.
    legacy_attribute_names: ClassVar[tuple[str, ...]] = ()
    # Whether checkpoints hold tensors of this class; a serving layout (DecodeWeight) is stored
    # as the tensor `stored()` gives, and a file naming it is refused.
    storable: ClassVar[bool] = True

    @staticmethod
    def __new__(cls, shape, dtype, device, **fields):
        self = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=device, requires_grad=False
        )
        return self

    def __init__(self, shape, dtype, device, **fields):
        missing = set(self.tensor_data_names + self.tensor_attribute_names) - set(fields)
        if missing:
            raise TypeError(f"{type(self).__name__} is missing fields {sorted(missing)}")
        for name, value in fields.items():
            setattr(self, name, value)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._op_table = {}
        if cls.tensor_data_names:
            if QuantizedTensor.classes.setdefault(cls.__name__, cls) is not cls:
                raise TypeError(f"a quantized tensor class named {cls.__name__} already exists.")

    # ---- plumbing derived from the declared names -------------------------------------------

    def fields(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.tensor_data_names + self.tensor_attribute_names}

    def replace(self, *, shape=None, dtype=None, **changes) -> "QuantizedTensor":
        """A new tensor of the same class with some fields changed (the `dataclasses.replace` idiom)."""
        fields = self.fields()
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(unknown)}")
        fields.update(changes)
        return type(self)(
            self.shape if shape is None else shape,
            self.dtype if dtype is None else dtype,
            fields[self.tensor_data_names[0]].device,
            **fields,
        )

    def map_data(self, fn: Callable[[torch.Tensor], torch.Tensor], **changes) -> "QuantizedTensor":
        """Apply fn to every inner tensor (None stays None)."""
        data = {
            n: (fn(t) if t is not None else None)
            for n, t in ((n, getattr(self, n)) for n in self.tensor_data_names)
        }
        return self.replace(**data, **changes)

    def __tensor_flatten__(self):
        # Computed once per tensor: a compiled function's guards flatten every quantized input on
        # every call, and `self.shape` and `self.dtype` each cost a __torch_function__ round trip.
        # The fields are set once, in __init__, so the result never goes stale.
        # The context is (shape, dtype, attributes, text): the text, the repr of the first
        # three, is what __metadata_guard__ compares.
        flat = self.__dict__.get("_flat")
        if flat is None:
            names = tuple(n for n in self.tensor_data_names if getattr(self, n) is not None)
            attrs = tuple(getattr(self, n) for n in self.tensor_attribute_names)
            meta = (tuple(self.shape), self.dtype, attrs)
            flat = self.__dict__["_flat"] = (names, meta + (repr(meta),))
        return list(flat[0]), flat[1]

    @classmethod
    def __metadata_guard__(cls, orig, new) -> bool:
        """Whether a graph compiled for a tensor of flatten context `orig` takes one of context
        `new` (torch.compile's guard, run for every quantized input on every call): their texts
        are equal. One string comparison instead of the fields' own __eq__, which took 1-2 us a
        tensor; the attributes are strings, numbers, dtypes and dataclasses, whose reprs name
        every field."""
        return orig[3] == new[3]

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        shape, dtype, attrs = ctx[:3]
        fields = dict(zip(cls.tensor_attribute_names, attrs))
        for n in cls.tensor_data_names:
            fields[n] = inner_tensors.get(n)
        device = inner_tensors[next(iter(inner_tensors))].device
        return cls(outer_size if outer_size is not None else shape, dtype, device, **fields)

    def _stable_hash_for_caching(self) -> str:
        """A deterministic key of what a compiled graph depends on, for torch.compile's AOT
        autograd cache: the class, outer shape, dtype and requires_grad, the decode attributes,
        and each inner tensor's shape, strides, dtype and device type (never its values)."""
        import hashlib
        import pickle

        inner = []
        for n in self.tensor_data_names:
            t = getattr(self, n)
            if t is None or isinstance(t, QuantizedTensor):
                inner.append((n, None if t is None else t._stable_hash_for_caching()))
            else:
                inner.append((n, str(tuple(t.shape)), str(t.stride()), str(t.dtype),
                              t.device.type))
        payload = (type(self).__module__, type(self).__qualname__, str(tuple(self.shape)),
                   str(self.dtype), self.requires_grad,
                   tuple((a, repr(getattr(self, a))) for a in self.tensor_attribute_names), inner)
        return hashlib.blake2b(pickle.dumps(payload), digest_size=16).hexdigest()

    @classmethod
    def gemm_backend_for(cls, device) -> str:
        """The GEMM backend a tensor of this class takes on `device` when it is made, moved or
        loaded there: the device's fastest (qtensor.backends.resolve_gemm_backend)."""
        return resolve_gemm_backend(device).value

    @classmethod
    def upgrade_attributes(cls, attrs: dict) -> dict:
        """Attributes stored under `legacy_attribute_names`, as the class holds them now."""
        return dict(attrs)

    def __getstate__(self):
        """The pickled state: the fields, without the cache `__tensor_flatten__` keeps (a pickle
        must not depend on whether the tensor was flattened before)."""
        state = dict(self.__dict__)
        state.pop("_flat", None)
        return state

    def __setstate__(self, state):
        """Unpickling (torch.load): a tensor pickled before the spec moved onto it comes back
        with today's attributes."""
        if isinstance(state, dict) and self.legacy_attribute_names and "spec" not in state and \
                set(self.legacy_attribute_names) <= set(state):
            legacy = {n: state[n] for n in self.legacy_attribute_names}
            rest = {k: v for k, v in state.items() if k not in legacy}
            state = {**rest, **self.upgrade_attributes(legacy)}
        torch._utils._set_obj_state(self, state)

    # ---- layout protocol ([Note: layout protocol]) --------------------------------------------

    def parts(self) -> dict[str, "QuantizedTensor"]:
        """The quantized inner tensors of a composite (a hybrid's two sides); {} for a class
        whose inner tensors are all plain."""
        return {n: t for n in self.tensor_data_names
                if isinstance(t := getattr(self, n), QuantizedTensor)}

    def shard_dims(self) -> dict[str, int | None]:
        """Inner tensor name -> the storage dim carrying the tensor's dim 0 (None: the inner
        tensor is replicated across dim-0 shards, e.g. a per-tensor amax)."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no storage layout (shard_dims), so it cannot be "
            "sharded; keep this parameter out of fully_shard (ignored_params)."
        )

    def storage_dim(self, dim: int) -> tuple[int, bool]:
        """(storage dim of the inner tensors, is block dim) for logical `dim`; the default is for
        classes whose codes and scales keep the logical dim order."""
        dim = dim % max(self.dim(), 1)
        return dim, self.block_size(dim) > 1

    def block_size(self, dim: int) -> int:
        """Elements one scale covers along logical `dim` (1 where no block runs along it): a
        slice or shard along `dim` must start and end at multiples of it."""
        parts = self.parts()
        if not parts:
            raise NotImplementedError(f"{type(self).__name__} declares no block_size.")
        return math.lcm(*(p.block_size(dim) for p in parts.values()))

    def flat(self) -> "QuantizedTensor | None":
        """The 1-D tensor `view(-1)` returns where blocks stay whole in row-major order, or
        None where the bytes have no 1-D reading (columnwise, row-scaled, composite)."""
        return None

    @classmethod
    def inner_layout(cls, shape: torch.Size, attrs: dict) -> dict[str, Any]:
        """{inner name: (shape, dtype)} a tensor of this class, logical shape and attributes
        holds; for a part of a composite, the axis that part must have. Raises ValueError when
        no tensor of the class has that shape."""
        raise NotImplementedError(
            f"{cls.__name__} declares no inner layout (inner_layout), so it cannot be stored "
            "in or checked against a checkpoint; implement the layout protocol for it.")

    def gemm_operand(self, side: str) -> "QuantizedTensor":
        """The operand a GEMM multiplies on `side` ("left": blocks along the last dim, "right":
        along dim -2): self when its blocks run that way (a composite hands over its matching
        part); anything else raises."""
        want = _GEMM_AXIS[side]
        if getattr(self, "axis", None) != want:
            raise ValueError(
                f"The {side} operand of a quantized GEMM needs its blocks along the reduction "
                f"dim ({want}); got {self!r}. Quantize it with columnwise={side == 'right'} or "
                "pass its transpose."
            )
        return self

    def gemm_rows(self, logical_rows: bool) -> tuple:
        """(data, scale, amax, bound) with rows along the reduction dim, as the GEMM ops take an
        operand: `logical_rows` for a left operand (its rows are the tensor's rows), else a right
        operand (its rows are the tensor's columns). amax and bound are None where the format
        has no per-tensor factor."""
        raise NotImplementedError(f"{type(self).__name__} has no GEMM operand of its own.")

    def stored(self) -> "QuantizedTensor":
        """The tensor checkpoints store for this one: itself, or for a serving layout (the
        decode layout) the canonical tensor it was packed from."""
        return self

    def pair_problem(self, other: "QuantizedTensor | None") -> str | None:
        """Why self cannot be multiplied with `other` (a quantized operand of the same class, or
        None for a high-precision one), beyond the shared rule of one format per product."""
        return None

    def __repr__(self):
        attrs = ", ".join(f"{n}={_fmt(getattr(self, n))}" for n in self.tensor_attribute_names)
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"{attrs}, device={self.device.type})"
        )

    # ---- op tables ----------------------------------------------------------------------------

    @classmethod
    def implements(cls, ops):
        """Decorator registering a handler for one or more aten ops on this class."""
        ops = ops if isinstance(ops, (list, tuple)) else [ops]

        def register(fn):
            for op in ops:
                cls._op_table[op] = fn
            return fn

        return register

    @classmethod
    def _find_op(cls, func):
        for klass in cls.__mro__:
            table = klass.__dict__.get("_op_table")
            if table is not None and func in table:
                return table[func]
        return None

    # torch-level functions handled before autograd and decomposition (F.linear, so a weight
    # can quantize its activation); everything else runs as plain torch and reaches the op table.
    _function_table: ClassVar[dict[Callable, OpHandler]] = {}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = QuantizedTensor._function_table.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = None
        for t in types:
            if issubclass(t, QuantizedTensor):
                handler = t._find_op(func)
                if handler is not None:
                    break
        if handler is None:
            arg_types = [type(a).__name__ for a in tree_flatten_args(args, kwargs)]
            raise NotImplementedError(
                f"{cls.__name__} does not implement {func} (argument types {arg_types}). "
                "Quantized tensors run only the ops in their op table; call .dequantize() "
                "first if a high-precision result is what you want. (Quantizing an already "
                "quantized model, e.g. with torchao's quantize_, ends here: apply it to the "
                "high-precision model instead.)"
            )
        return handler(func, args, kwargs)


def tree_flatten_args(args, kwargs):
    flat = []
    tree_map(lambda a: flat.append(a), (args, kwargs))
    return flat


def _fmt(v):
    if isinstance(v, str):
        return v
    if dataclasses.is_dataclass(v):
        inner = ", ".join(
            f"{f.name}={_fmt(getattr(v, f.name))}"
            for f in dataclasses.fields(v)
            if getattr(v, f.name) != f.default
        )
        return f"{type(v).__name__}({inner})"
    return repr(v)
