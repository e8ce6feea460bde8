"""save_file / load_file: quantized state_dicts in safetensors files, tensor by tensor.

The file is a standard safetensors file (any safetensors reader lists and reads its tensors):
plain tensors under their keys, a quantized tensor's inner tensors under `KEY::NAME`, and the
qtensor JSON header (qtensor/checkpoint/schema.py) under the `qtensor` entry of
`__metadata__`. Writing streams: the header is computed from shapes alone, then each tensor is
written and released, so saving never holds a second copy of the model; a file appears under
its name only once complete (written to `NAME.tmp`, then renamed). Reading goes through the
safetensors library, which checks the header's offsets against the file size before any tensor
is read; every quantized entry is then checked against its class's layout (shape and dtype of
each inner tensor) before its bytes are read. `Files` reads a state_dict stored over several
files (a sharded checkpoint) the same way, the files' headers merged.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from typing import Any, Iterable, Mapping

import torch

from qtensor.checkpoint.schema import SEP, CheckpointError, decode, encode, header, parse_header
from qtensor.tensors import QuantizedTensor

META_KEY = "qtensor"
# safetensors dtype names (the format's spec); anything else cannot be stored.
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class Progress:
    """A one-line progress bar on stderr: 'saving model.safetensors: 12/40 tensors, 3.1 MiB'."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled, self.done, self.nbytes = label, total, enabled, 0, 0

    def step(self, t: torch.Tensor) -> None:
        self.done += 1
        self.nbytes += t.numel() * t.element_size()
        if self.enabled:
            end = "\n" if self.done == self.total else ""
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} tensors, "
                             f"{self.nbytes / 2**20:.1f} MiB{end}")
            sys.stderr.flush()


def flatten(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """({stored name: plain tensor}, {key: JSON entry}) of a state_dict; no bytes are copied."""
    flat: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{key!r}: only tensors can be stored; got {type(t).__name__}.")
        if SEP in key:
            raise CheckpointError(f"{key!r}: state_dict keys must not contain {SEP!r}.")
        if isinstance(t, QuantizedTensor):
            entries[key], inner = encode(key, t)
            flat.update(inner)
        else:
            flat[key] = t
    for name, t in flat.items():
        if t.dtype not in ST_DTYPES:
            raise CheckpointError(f"{name!r}: dtype {t.dtype} has no safetensors name.")
    return flat, entries


def save_file(
    state_dict: Mapping[str, Any], path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None,
    progress: bool = False,
) -> None:
    """Write a (quantized) state_dict to a safetensors file; see the module docstring."""
    flat, entries = flatten(state_dict)
    meta = dict(metadata or {})
    if META_KEY in meta:
        raise CheckpointError(f"metadata key {META_KEY!r} is reserved for qtensor.")
    meta[META_KEY] = header(entries)
    head: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, t in flat.items():
        n = t.numel() * t.element_size()
        head[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes with spaces
    tmp = f"{os.fspath(path)}.tmp"
    bar = Progress(f"saving {os.path.basename(path)}", len(flat), progress)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in flat.values():
            f.write(_bytes(t))
            bar.step(t)
    os.replace(tmp, path)


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _open(path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(os.fspath(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{os.fspath(path)!r} is not a readable safetensors file: {e}.") from None


class Files:
    """The tensors of one state_dict in one safetensors file or several (the shards of a sharded
    checkpoint): every tensor name and the file holding it, and the union of the files' qtensor
    headers (a writer that shards after flattening, as transformers does, puts the whole header
    in every shard, and a quantized tensor's inner tensors may land in different shards).
    Opening reads headers only; a context manager, closing the files on exit."""

    def __init__(self, paths: Iterable[str | os.PathLike]):
        self.paths = [os.fspath(p) for p in paths]
        self.where = "the file" if len(self.paths) == 1 else "the checkpoint's files"
        self._stack = contextlib.ExitStack()
        self.file_of: dict[str, Any] = {}  # tensor name -> its open file
        self.entries: dict[str, dict] = {}  # state_dict key -> its qtensor header entry
        try:
            self._read_headers()
        except BaseException:
            self._stack.close()
            raise

    def _read_headers(self) -> None:
        origin: dict[str, str] = {}
        for path in self.paths:
            f = self._stack.enter_context(_open(path))
            for name in f.keys():
                if name in self.file_of:
                    raise CheckpointError(f"{name!r}: stored in both {origin[name]!r} and "
                                          f"{path!r}.")
                self.file_of[name], origin[name] = f, path
            meta = f.metadata() or {}
            if META_KEY not in meta:
                continue
            for key, entry in parse_header(meta[META_KEY], path).items():
                if key in self.entries and self.entries[key] != entry:
                    raise CheckpointError(f"{key!r}: the qtensor headers of {origin[key]!r} and "
                                          f"{path!r} describe it differently.")
                self.entries[key], origin[key] = entry, path

    def __enter__(self) -> "Files":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def check(self) -> set[str]:
        """Check every header entry against the files' tensor headers (each inner tensor there,
        with the shape and dtype its class derives) without reading a byte, and that every inner
        tensor belongs to an entry; returns the names of the inner tensors."""
        used: set[str] = set()

        def check(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            if name not in self.file_of:
                raise CheckpointError(f"{name!r}: missing from {self.where} (named by the "
                                      "metadata).")
            view = self.file_of[name].get_slice(name)
            got_dtype, got_shape = ST_NAMES.get(view.get_dtype()), torch.Size(view.get_shape())
            if got_dtype != dtype or got_shape != shape:
                holds = "the file holds" if len(self.paths) == 1 else "the checkpoint holds"
                raise CheckpointError(
                    f"{name!r}: {holds} {view.get_dtype()} {list(got_shape)}, the metadata "
                    f"implies {dtype} {list(shape)}."
                )
            used.add(name)
            return torch.empty(shape, dtype=dtype, device="meta")

        for key, entry in self.entries.items():
            decode(key, entry, check)
        _check_unreferenced(set(self.file_of) - used, self.entries)
        return used

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        return self.file_of[name].get_tensor(name).to(device)

    def load(self, device: str | torch.device = "cpu",
             progress: bool = False) -> dict[str, torch.Tensor]:
        """The whole state_dict, checked first (`check`), quantized tensors rebuilt."""
        inner = self.check()
        label = (os.path.basename(self.paths[0]) if len(self.paths) == 1
                 else f"{len(self.paths)} files")
        bar = Progress(f"loading {label}", len(self.file_of), progress)

        def fetch(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            t = self.get(name, device)
            bar.step(t)
            return t

        out: dict[str, torch.Tensor] = {}
        for key, entry in self.entries.items():
            out[key] = decode(key, entry, fetch)
        for name in sorted(set(self.file_of) - inner):
            out[name] = fetch(name, None, None)
        return out


def load_file(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", progress: bool = False
) -> dict[str, torch.Tensor]:
    """The state_dict saved by save_file, quantized tensors rebuilt; nothing in the file is
    executed. Raises CheckpointError naming the key and field of any inconsistency."""
    with Files([path]) as f:
        return f.load(device, progress)


def load_files(
    paths: Iterable[str | os.PathLike], *, device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """load_file over the shards of one state_dict (see `Files`)."""
    with Files(paths) as f:
        return f.load(device, progress)


def _check_unreferenced(names: Iterable[str], entries: Mapping[str, dict]) -> None:
    for name in names:
        if SEP in name:
            raise CheckpointError(
                f"{name!r}: an inner tensor that no metadata entry names (unexpected key); the "
                "file was not written by qtensor.save_file or its metadata was edited."
            )
    clash = [k for k in entries if k in names]
    if clash:
        raise CheckpointError(f"{clash[0]!r}: stored both as a plain tensor and as a quantized one.")
