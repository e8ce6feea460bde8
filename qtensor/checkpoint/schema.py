"""Versioned JSON metadata for quantized tensors: written from the declared fields, read back
through an allowlist.

[Note: checkpoint schema]
A quantized tensor is stored as its inner tensors (plain tensors, under `KEY::NAME`, nested
`KEY::rowwise::qdata` for a hybrid) plus one JSON entry per state_dict key:

    {"class": "NVFP4Tensor", "shape": [32, 64], "dtype": "bfloat16",
     "attributes": {"axis": "rowwise", "e4m3_bound": 256, ...},
     "data": {"qdata": "0.weight::qdata", "scale": "0.weight::scale", "amax": "0.weight::amax"}}

Reading never evaluates or imports anything named by the file: class, spec and dtype names are
looked up in the fixed tables below, every attribute value is checked against the values the
class accepts, and the inner tensors' shapes and dtypes must be exactly those the class derives
from the outer shape and attributes (so a file cannot make a decoder read out of bounds).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping

import torch

from qtensor.backends import GemmBackend, QuantBackend
from qtensor.formats import mxfp8, nvfp4
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp4 import MXFP4Spec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.tensors import QuantizedTensor
from qtensor.tensors.common import COLUMNWISE, ROWWISE
from qtensor.tensors.hybrid import SOURCES

FORMAT = "qtensor.checkpoint"
# 2: a single-format tensor stores its spec as one attribute ([Note: spec on the tensor] in
# qtensor/tensors/base.py). Version 1 files, which unpack it (and carry a `scale_layout` that
# only ever held "compact"), are read too.
VERSION = 2
READABLE_VERSIONS = (1, 2)
SEP = "::"  # joins a state_dict key and an inner tensor's name

# qtensor's own classes by name: a file names a class, never a module to import.
CLASSES: dict[str, type[QuantizedTensor]] = QuantizedTensor.classes
SPECS = {c.__name__: c for c in (NVFP4Spec, MXFP8Spec, FP8BlockSpec, MXFP4Spec)}
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.bfloat16, torch.float16, torch.uint8,
        torch.float8_e4m3fn, torch.float8_e8m0fnu,
    )
}
ENTRY_KEYS = {"class", "shape", "dtype", "attributes", "data"}
HEADER_KEYS = {"format", "version", "tensors"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the key and the field."""


def _one_of(*allowed):
    def check(v):
        return v in allowed and type(v) is type(next(a for a in allowed if a == v))

    check.allowed = allowed
    return check


_BOOL = _one_of(True, False)
# Allowed values of every attribute a class declares, from the definitions the specs and
# tensors validate against (a bool field of a spec takes a bool); an attribute missing here (a
# field added later) must still be a JSON scalar.
_SPEC_CHOICES = {"fourover6": nvfp4.FOUROVERSIX_MODES, "e4m3_bound": nvfp4.E4M3_BOUNDS,
                 "scale_rule": mxfp8.SCALE_RULES}
ATTRIBUTE_RULES: dict[str, Callable[[Any], bool]] = {
    **{f.name: _BOOL for spec in (NVFP4Spec, MXFP8Spec, FP8BlockSpec, MXFP4Spec)
       for f in dataclasses.fields(spec) if f.type == "bool"},
    **{name: _one_of(*values) for name, values in _SPEC_CHOICES.items()},
    "axis": _one_of(ROWWISE, COLUMNWISE),
    "scale_layout": _one_of("compact"),  # version 1 only
    "columnwise_source": _one_of(*SOURCES),
    "quant_backend": _one_of(*(b.value for b in QuantBackend)),
    "gemm_backend": _one_of(*(b.value for b in GemmBackend)),
}


# ---- writing ------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored; allowed: {sorted(DTYPES)}.")
    return name


def _encode_value(v):
    if dataclasses.is_dataclass(v):
        if type(v).__name__ not in SPECS:
            raise CheckpointError(f"cannot store an attribute of type {type(v).__name__}.")
        return {"spec": type(v).__name__, "fields": dataclasses.asdict(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v.value if isinstance(v, str) and hasattr(v, "value") else v
    raise CheckpointError(f"cannot store an attribute value {v!r} of type {type(v).__name__}.")


def encode(key: str, t: QuantizedTensor) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON entry, {flat name: inner tensor}) of one quantized tensor stored under `key`."""
    t = t.stored()
    if type(t).__name__ not in CLASSES:
        raise CheckpointError(f"{key!r}: {type(t).__name__} is not a storable class.")
    flat: dict[str, torch.Tensor] = {}
    data: dict[str, Any] = {}
    for name in t.tensor_data_names:
        inner, sub = getattr(t, name), f"{key}{SEP}{name}"
        if inner is None:
            data[name] = None
        elif isinstance(inner, QuantizedTensor):
            data[name], more = encode(sub, inner)
            flat.update(more)
        else:
            data[name], flat[sub] = sub, inner
    entry = {
        "class": type(t).__name__,
        "shape": list(t.shape),
        "dtype": dtype_name(t.dtype),
        "attributes": {n: _encode_value(getattr(t, n)) for n in t.tensor_attribute_names},
        "data": data,
    }
    return entry, flat


def header(entries: Mapping[str, dict]) -> str:
    return json.dumps({"format": FORMAT, "version": VERSION, "tensors": dict(entries)})


# ---- reading ------------------------------------------------------------------------------------


def parse_header(text: str, where: str) -> dict[str, dict]:
    """The per-key entries of a header, after checking its format, version and keys."""
    try:
        head = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{where}: the qtensor metadata is not valid JSON ({e}).") from None
    if not isinstance(head, dict) or set(head) != HEADER_KEYS:
        got = sorted(head) if isinstance(head, dict) else type(head).__name__
        raise CheckpointError(f"{where}: metadata needs exactly the keys {sorted(HEADER_KEYS)}; "
                              f"got {got}.")
    if head["format"] != FORMAT:
        raise CheckpointError(f"{where}: metadata format is {head['format']!r}, not {FORMAT!r}.")
    if head["version"] not in READABLE_VERSIONS or type(head["version"]) is not int:
        raise CheckpointError(
            f"{where}: metadata version {head['version']!r} is not readable by this qtensor "
            f"(reads versions {list(READABLE_VERSIONS)}). Load it with the qtensor release "
            "that wrote it."
        )
    if not isinstance(head["tensors"], dict):
        raise CheckpointError(f"{where}: metadata 'tensors' must be an object.")
    return head["tensors"]


def _fail(key: str, field: str, why: str):
    raise CheckpointError(f"{key!r}: field {field!r} {why}")


def _decode_value(key, name, v):
    if isinstance(v, dict):
        if set(v) != {"spec", "fields"} or v["spec"] not in SPECS or not isinstance(v["fields"], dict):
            _fail(key, name, f"must be null or a spec {{'spec': one of {sorted(SPECS)}, "
                             f"'fields': {{...}}}}; got {v!r}.")
        cls = SPECS[v["spec"]]
        names = {f.name for f in dataclasses.fields(cls)}
        if set(v["fields"]) != names or not all(_scalar(x) for x in v["fields"].values()):
            _fail(key, name, f"needs exactly the {cls.__name__} fields {sorted(names)} with "
                             f"scalar values; got {v['fields']!r}.")
        try:
            return cls(**v["fields"])
        except (ValueError, TypeError) as e:
            _fail(key, name, f"is not a valid {cls.__name__}: {e}")
    rule = ATTRIBUTE_RULES.get(name, _scalar)
    if not rule(v):
        allowed = getattr(rule, "allowed", "a JSON scalar")
        _fail(key, name, f"must be one of {allowed}; got {v!r}.")
    return v


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _shape(key, field, v) -> list[int]:
    if not isinstance(v, list) or not all(type(s) is int and s >= 0 for s in v):
        _fail(key, field, f"must be a list of non-negative integers; got {v!r}.")
    return v


def decode(key: str, entry: Any, fetch: Callable[[str, torch.Size, torch.dtype], torch.Tensor]):
    """Rebuild the quantized tensor of `entry`. fetch(name, shape, dtype) returns an inner tensor
    after checking it has that shape and dtype; shapes come from `expected_layout`."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise CheckpointError(f"{key!r}: an entry needs exactly the fields {sorted(ENTRY_KEYS)};"
                              f" got {got}.")
    cls = CLASSES.get(entry["class"]) if isinstance(entry["class"], str) else None
    if cls is None or not cls.storable:
        names = sorted(n for n, c in CLASSES.items() if c.storable)
        _fail(key, "class", f"must be one of {names}; got {entry['class']!r}.")
    if entry["dtype"] not in DTYPES or DTYPES[entry["dtype"]] not in (
        torch.float32, torch.bfloat16, torch.float16
    ):
        _fail(key, "dtype", f"must be float32, bfloat16 or float16; got {entry['dtype']!r}.")
    shape = torch.Size(_shape(key, "shape", entry["shape"]))
    attrs, data = entry["attributes"], entry["data"]
    names = cls.tensor_attribute_names
    if isinstance(attrs, dict) and cls.legacy_attribute_names and "spec" not in attrs:
        names = cls.legacy_attribute_names  # a version 1 entry: the spec unpacked
    if not isinstance(attrs, dict) or set(attrs) != set(names):
        _fail(key, "attributes", f"needs exactly {list(cls.tensor_attribute_names)}; got "
                                 f"{sorted(attrs) if isinstance(attrs, dict) else attrs!r}.")
    if not isinstance(data, dict) or set(data) != set(cls.tensor_data_names):
        _fail(key, "data", f"needs exactly {list(cls.tensor_data_names)}; got "
                           f"{sorted(data) if isinstance(data, dict) else data!r}.")
    fields = {n: _decode_value(key, n, attrs[n]) for n in names}
    if names is not cls.tensor_attribute_names:
        try:
            fields = cls.upgrade_attributes(fields)
        except ValueError as e:
            _fail(key, "attributes", f"do not form a valid {cls.spec_type.__name__}: {e}")
    if cls.spec_type is not None and type(fields["spec"]) is not cls.spec_type:
        _fail(key, "spec", f"must be a {cls.spec_type.__name__}; got {fields['spec']!r}.")
    layout = expected_layout(key, cls, shape, fields)
    for name in cls.tensor_data_names:
        sub, want = f"{key}{SEP}{name}", layout[name]
        if isinstance(want, str):  # a part of a composite: a quantized tensor with that axis
            t = decode(sub, data[name], fetch)
            if t.shape != shape or t.axis != want:
                _fail(key, name, f"must be a {want} tensor of shape {list(shape)}; got {t!r}.")
            fields[name] = t
        elif data[name] is None:
            _fail(key, name, "is null, but this tensor class needs it.")
        elif data[name] != sub:
            _fail(key, name, f"must name the stored tensor {sub!r}; got {data[name]!r}.")
        else:
            fields[name] = fetch(sub, *want)
    device = next(iter(fields[n] for n in cls.tensor_data_names)).device
    if "gemm_backend" in fields:
        # The GEMM backend belongs to the device the bytes land on, chosen there as for any
        # tensor made or moved (a checkpoint written on the CPU says "emulated").
        fields["gemm_backend"] = cls.gemm_backend_for(device)
    return cls(shape, DTYPES[entry["dtype"]], device, **fields)


def expected_layout(key: str, cls, shape: torch.Size, attrs: dict) -> dict:
    """{inner name: (shape, dtype)} a tensor of this class, shape and attributes must hold (its
    class's `inner_layout`); for a part of a composite, the axis that part must have."""
    try:
        return cls.inner_layout(shape, attrs)
    except ValueError as e:
        _fail(key, "shape", f"{e}")
