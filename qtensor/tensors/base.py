"""QuantizedTensor: the plumbing every quantized tensor class shares, declared once.

[Note: quantized tensors]
A quantized tensor is a wrapper subclass whose outer shape and dtype are the high-precision
tensor it stands for (the dtype is also the dtype its products are returned in). The bytes live
in inner tensors named by `tensor_data_names`; the decode metadata lives in plain attributes
named by `tensor_attribute_names`. Flatten/unflatten, repr, `replace` and pickling are derived
from those two tuples. Every aten op goes through the class's op table: an op that is not in
it raises NotImplementedError naming the op and the argument types. Nothing dequantizes
behind the user's back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import torch
from torch.utils._pytree import tree_map

OpHandler = Callable[..., Any]


class QuantizedTensor(torch.Tensor):
    tensor_data_names: ClassVar[tuple[str, ...]] = ()
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ()
    # Filled per subclass by `implements`; a subclass sees its own ops and then the base's.
    _op_table: ClassVar[dict[Any, OpHandler]] = {}

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
        names = [n for n in self.tensor_data_names if getattr(self, n) is not None]
        attrs = tuple(getattr(self, n) for n in self.tensor_attribute_names)
        return names, (tuple(self.shape), self.dtype, attrs)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        shape, dtype, attrs = ctx
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

    # ---- FSDP2 all-gather hooks ([Note: quantized FSDP2 shards], qtensor/distributed/fsdp.py) --

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        from qtensor.distributed.fsdp import pre_all_gather

        return pre_all_gather(self, mesh, outer_size, module)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from qtensor.distributed.fsdp import post_all_gather

        return post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)

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
