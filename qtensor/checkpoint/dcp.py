"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save on N ranks, load on M.

[Note: DCP of quantized tensors]
DCP reshards plain tensors and DTensors, not tensor subclasses. `save` replaces each quantized
tensor by a dict of its inner tensors ({"qdata": ..., "scale": ..., "amax": ...}; DCP stores
them as `KEY.qdata` ...), and a DTensor whose local tensor is quantized (a row shard, as FSDP2
holds it) by DTensors of its inner tensors: an inner tensor whose size differs between the
local and the global layout is sharded along that dim, the others (a scalar amax) replicated.
Resharding on load is then DCP's own. The decode attributes go in one JSON blob (the schema of
qtensor/checkpoint/schema.py) stored as a replicated uint8 tensor, so loading unpickles nothing;
`load` also reads DCP's non-tensor items (optimizer hyperparameters) with weights_only=True,
where DCP's default planner would unpickle them without restriction.

[Note: complete checkpoints]
`save` writes into `PATH.incomplete`, then, after a barrier, rank 0 writes the marker
`.qtensor_complete` last and renames the directory to PATH (the previous PATH is moved aside
to `PATH.old` first and removed after). A save killed half-way leaves PATH as it was and
`PATH.incomplete` without a marker; `load` refuses any directory without the marker.
Two renames are not one atomic step: a rank 0 killed between them leaves no PATH, the
previous checkpoint complete in `PATH.old` and the new one complete (marker written) in
`PATH.incomplete`. `load(PATH)` then reads the newest complete one, `PATH.incomplete`
(`resolve`), and the next `save` to PATH finishes normally (it clears `PATH.incomplete` first
and finds no PATH to move aside).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.tensor import DTensor, Replicate, Shard

from qtensor.checkpoint.schema import SEP, CheckpointError, decode, encode, expected_layout, header
from qtensor.checkpoint.schema import parse_header
from qtensor.distributed.master import QuantizeOnGatherWeight
from qtensor.tensors import QuantizedTensor
from qtensor.tensors.common import metadata_mismatch

META = "__qtensor__"
MARKER = ".qtensor_complete"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _attrs(t: QuantizedTensor) -> dict:
    return {n: getattr(t, n) for n in t.tensor_attribute_names}


def _inner_dict(t: QuantizedTensor) -> dict:
    return {n: (_inner_dict(v) if isinstance(v, QuantizedTensor) else v)
            for n in t.tensor_data_names if (v := getattr(t, n)) is not None}


def _inner_dtensors(key: str, local: QuantizedTensor, shape: torch.Size, mesh) -> dict:
    """DTensors of the inner tensors of a row shard `local` of a tensor of global `shape`."""
    if local.parts():
        return {n: _inner_dtensors(key, part, shape, mesh) for n, part in local.parts().items()}
    cls, attrs = type(local), _attrs(local)
    glob = expected_layout(key, cls, shape, attrs)
    loc = expected_layout(key, cls, local.shape, attrs)
    out = {}
    for name, (gshape, _) in glob.items():
        inner = getattr(local, name).contiguous()
        if inner.shape != loc[name][0]:
            raise CheckpointError(f"{key!r}: inner tensor {name!r} has shape "
                                  f"{tuple(inner.shape)}, expected {tuple(loc[name][0])}.")
        dims = [d for d, (g, s) in enumerate(zip(gshape, inner.shape)) if g != s]
        if len(dims) > 1:
            raise CheckpointError(f"{key!r}: inner tensor {name!r} is sharded on dims {dims}.")
        placement = Shard(dims[0]) if dims else Replicate()
        out[name] = DTensor.from_local(inner, mesh, [placement], run_check=False,
                                       shape=gshape, stride=_contiguous_stride(gshape))
    return out


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def split(obj: Any, path: str = "", entries: dict | None = None):
    """(obj with quantized tensors replaced by dicts of inner tensors, {path: JSON entry})."""
    entries = {} if entries is None else entries
    if isinstance(obj, dict):
        return {k: split(v, f"{path}.{k}" if path else str(k), entries)[0]
                for k, v in obj.items()}, entries
    if isinstance(obj, DTensor) and isinstance(obj._local_tensor, QuantizedTensor):
        if obj.device_mesh.ndim != 1 or obj.placements[0] not in (Shard(0), Replicate()):
            raise CheckpointError(f"{path!r}: quantized DTensors must be Shard(0) or "
                                  f"Replicate() on a 1-D mesh; got {obj.placements}.")
        entries[path], _ = encode(path, obj._local_tensor)
        _set_shape(entries[path], list(obj.shape))
        return _inner_dtensors(path, obj._local_tensor, obj.shape, obj.device_mesh), entries
    if isinstance(obj, QuantizedTensor):
        entries[path], _ = encode(path, obj)
        return _inner_dict(obj), entries
    return _unwrap_master(obj), entries


def _unwrap_master(obj):
    """A quantize-on-gather master weight (or its Adam moment) as the plain high-precision
    tensor it wraps, as a DTensor if it was one; other objects unchanged. The wrapper is
    qtensor's own class: stored as is, DCP would pickle it (and `load` refuse the global)."""
    local = obj._local_tensor if isinstance(obj, DTensor) else obj
    if not isinstance(local, QuantizeOnGatherWeight):
        return obj
    if not isinstance(obj, DTensor):
        return local._data
    return DTensor.from_local(local._data, obj.device_mesh, obj.placements, run_check=False,
                              shape=obj.shape, stride=obj.stride())


def _forget_amaxes(obj) -> None:
    """Loaded master weights changed below their Parameters' version counters, so the global
    amaxes taken before are stale: drop them (the next forward then asks for
    precompute_amaxes instead of quantizing with an old amax)."""
    if isinstance(obj, dict):
        for v in obj.values():
            _forget_amaxes(v)
        return
    local = obj._local_tensor if isinstance(obj, DTensor) else obj
    if isinstance(local, QuantizeOnGatherWeight):
        local.amax, local._amax_stamp = None, None


def _set_shape(entry: dict, shape: list[int]) -> None:
    """Give an entry (and a hybrid's sides, which share its logical shape) the global shape."""
    entry["shape"] = shape
    for sub in entry["data"].values():
        if isinstance(sub, dict):
            _set_shape(sub, shape)


def _barrier(group=None):
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def save(state_dict: dict, path: str | os.PathLike, *, process_group=None) -> None:
    """Save a (sharded) state_dict, quantized tensors included; collective on every rank of
    `process_group` (default: the default group)."""
    path = os.fspath(path)
    tmp = f"{path}.incomplete"
    if _rank(process_group) == 0 and os.path.exists(tmp):
        if not os.path.exists(path) and is_complete(tmp):
            # A save died between its two renames: tmp is the newest complete checkpoint
            # (what `load` reads now). Finish that rename before writing the next one, so a
            # death during this save still leaves it.
            os.replace(tmp, path)
        else:
            shutil.rmtree(tmp)  # what an interrupted save left behind
    _barrier(process_group)
    flat, entries = split(state_dict)
    blob = header(entries).encode()
    flat[META] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    dcp.save(flat, checkpoint_id=tmp, process_group=process_group)
    _barrier(process_group)  # every rank's shards are on disk
    if _rank(process_group) == 0:
        with open(os.path.join(tmp, MARKER), "w") as f:
            world = dist.get_world_size(process_group) if dist.is_initialized() else 1
            json.dump({"world_size": world}, f)
            f.flush()
            os.fsync(f.fileno())
        old = f"{path}.old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(process_group)


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MARKER))


def resolve(path: str | os.PathLike) -> str:
    """The directory `load(path)` reads: `path`, unless a save died between its two renames
    and left no `path` ([Note: complete checkpoints]); then the newest complete one of
    `path.incomplete` (the new checkpoint, marker written) and `path.old` (the previous)."""
    path = os.fspath(path)
    if os.path.exists(path):
        return path
    for candidate in (f"{path}.incomplete", f"{path}.old"):
        if is_complete(candidate):
            warnings.warn(f"{path!r} does not exist: a save to it died while renaming; "
                          f"loading the complete checkpoint {candidate!r} instead.",
                          stacklevel=3)
            return candidate
    return path


def read_entries(path: str | os.PathLike, process_group=None) -> tuple[dict, Any]:
    """({key: JSON entry}, DCP storage metadata) of a complete checkpoint (collective)."""
    path = resolve(path)
    if not is_complete(path):
        raise CheckpointError(
            f"{path!r} is not a complete qtensor checkpoint (no {MARKER} marker): its save was "
            "interrupted or it was not written by qtensor.checkpoint.dcp.save. Load the "
            "previous checkpoint instead."
        )
    md = FileSystemReader(path).read_metadata()
    if META not in md.state_dict_metadata:
        raise CheckpointError(f"{path!r}: no {META} entry; not written by qtensor.")
    buf = torch.zeros(md.state_dict_metadata[META].size, dtype=torch.uint8)
    dcp.load({META: buf}, checkpoint_id=path, planner=SafeLoadPlanner(allow_partial_load=True),
             process_group=process_group)
    return parse_header(bytes(buf.numpy()).decode(errors="replace"), path), md


def _check(key: str, entry: dict, want: dict, md) -> None:
    """Raise unless the checkpoint's entry is consistent with the stored tensors and matches
    the target's entry `want` (class, global shape, metadata; both JSON, global shapes)."""
    def fetch(name, shape, dtype):
        fqn = name.replace(SEP, ".")
        item = md.state_dict_metadata.get(fqn)
        if item is None or not hasattr(item, "size"):
            raise CheckpointError(f"{fqn!r}: missing from the checkpoint.")
        if item.size != shape or item.properties.dtype != dtype:
            raise CheckpointError(f"{fqn!r}: the checkpoint holds {item.properties.dtype} "
                                  f"{list(item.size)}, its metadata implies {dtype} {list(shape)}.")
        return torch.empty(shape, dtype=dtype, device="meta")

    got = decode(key, entry, fetch)
    differ = _mismatch(decode(key, want, _meta), got)
    if differ:
        raise CheckpointError(f"{key!r}: the target and the checkpoint differ (target != "
                              f"checkpoint): {', '.join(differ)}.")


def _meta(name, shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _mismatch(want: QuantizedTensor, got: QuantizedTensor, side: str = "") -> list[str]:
    """What differs between two tensors' class, shape and metadata (field by field)."""
    if type(want) is not type(got):
        return [f"{side}class: {type(want).__name__!r} != {type(got).__name__!r}"]
    if want.shape != got.shape:
        return [f"{side}shape: {list(want.shape)} != {list(got.shape)}"]
    out = [f"{side}{d}" for d in metadata_mismatch(want, got)]
    for name, part in want.parts().items():
        out += _mismatch(part, getattr(got, name), f"{side}{name}.")
    return out


def load(state_dict: dict, path: str | os.PathLike, *, process_group=None) -> None:
    """Load a checkpoint into `state_dict` in place, resharding as DCP does; every quantized
    entry is checked against its target before any byte is read (collective on every rank of
    `process_group`, default: the default group)."""
    path = resolve(path)
    entries, md = read_entries(path, process_group)
    flat, targets = split(state_dict)
    for key in targets:
        if key not in entries:
            raise CheckpointError(f"{key!r}: the target is quantized but the checkpoint holds "
                                  "no quantized tensor under this key.")
    for key, entry in entries.items():
        target = _lookup(state_dict, key)
        if not isinstance(target, torch.Tensor):
            continue  # not requested: partial loads of quantized entries are DCP's business
        if key not in targets:
            raise CheckpointError(f"{key!r}: the checkpoint holds a {entry.get('class')} but "
                                  "the target is a high-precision tensor.")
        _check(key, entry, targets[key], md)
    dcp.load(flat, checkpoint_id=path, planner=SafeLoadPlanner(), process_group=process_group)
    _write_back(state_dict, flat)
    _forget_amaxes(state_dict)


def sr_states(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{"MODULE.sr_state": buffer} of every module that rounds gradients stochastically.

    [Note: stochastic-rounding state in training checkpoints]
    A TrainingLinear keeps where its stochastic-rounding streams stand in `sr_state`, an int64
    buffer of (seed, offset) rows that every training forward advances in place
    (qtensor/training/linear.py). It is non-persistent, so `model.state_dict()` (and
    `get_state_dict`) leave it out, and a run resumed from weights and optimizer state alone
    replays the first step's rounding. Save these buffers next to them, e.g.
    `{"model": msd, "optim": osd, "sr": sr_states(model)}`: the values are the buffers
    themselves, so `load` writes the saved positions straight into the model. Every rank
    advances identical buffers, so DCP stores one copy, loadable on any world size.
    """
    return {f"{name}.sr_state" if name else "sr_state": buf
            for name, module in model.named_modules()
            if isinstance(buf := getattr(module, "sr_state", None), torch.Tensor)}


def _lookup(d: dict, key: str):
    """d's value at a dotted DCP path whose own keys may contain dots."""
    if key in d:
        return d[key]
    for k, v in d.items():
        if isinstance(v, dict) and key.startswith(f"{k}."):
            found = _lookup(v, key[len(k) + 1:])
            if found is not None:
                return found
    return None


def _write_back(dst: dict, src: dict) -> None:
    """Copy non-tensor leaves DCP replaced in `src` (hyperparameters) back into `dst`."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _write_back(dst[k], v)
        elif not isinstance(v, (torch.Tensor, dict)):
            dst[k] = v
