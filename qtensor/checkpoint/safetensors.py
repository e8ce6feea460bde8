"""save_file / load_file: quantized state_dicts in safetensors files, tensor by tensor.

The file is a standard safetensors file (any safetensors reader lists and reads its tensors):
plain tensors under their keys, a quantized tensor's inner tensors under `KEY::NAME`, and the
qtensor JSON header (qtensor/checkpoint/schema.py) under the `qtensor` entry of
`__metadata__`. Writing streams: the header is computed from shapes alone, then each tensor is
written and released, so saving never holds a second copy of the model; a file appears under
its name only once complete (written to `NAME.tmp`, then renamed). Reading goes through the
safetensors library, which checks the header's offsets against the file size before any tensor
is read; every quantized entry is then checked against its class's layout (shape and dtype of
each inner tensor) before its bytes are read.
"""

from __future__ import annotations

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


def load_file(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", progress: bool = False
) -> dict[str, torch.Tensor]:
    """The state_dict saved by save_file, quantized tensors rebuilt; nothing in the file is
    executed. Raises CheckpointError naming the key and field of any inconsistency."""
    with _open(path) as f:
        names = set(f.keys())
        meta = f.metadata() or {}
        entries = parse_header(meta[META_KEY], os.fspath(path)) if META_KEY in meta else {}
        used: set[str] = set()

        def check(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            if name not in names:
                raise CheckpointError(f"{name!r}: missing from the file (named by the metadata).")
            view = f.get_slice(name)
            got_dtype, got_shape = ST_NAMES.get(view.get_dtype()), torch.Size(view.get_shape())
            if got_dtype != dtype or got_shape != shape:
                raise CheckpointError(
                    f"{name!r}: the file holds {view.get_dtype()} {list(got_shape)}, the metadata "
                    f"implies {dtype} {list(shape)}."
                )
            used.add(name)
            return torch.empty(shape, dtype=dtype, device="meta")

        # Pass 1 checks every entry against the file's header without reading a byte.
        for key, entry in entries.items():
            decode(key, entry, check)
        _check_unreferenced(names - used, entries)
        bar = Progress(f"loading {os.path.basename(path)}", len(names), progress)

        def fetch(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            t = f.get_tensor(name).to(device)
            bar.step(t)
            return t

        out: dict[str, torch.Tensor] = {}
        for key, entry in entries.items():
            out[key] = decode(key, entry, fetch)
        for name in sorted(names - used):
            out[name] = fetch(name, None, None)
    return out


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
