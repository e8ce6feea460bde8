"""What every reader of a transformers checkpoint directory shares (checkpoint/pretrained.py,
checkpoint/gpt_oss.py): its files, its tensors read by name (shapes and dtypes before
data), and placing tensors into a model built on the meta device.

The plain (unquantized) tensors follow one rule for every layout: each parameter and persistent
buffer of the model that is not quantized is in the checkpoint with the model's shape (a tied
weight may be stored once), the checkpoint holds nothing else, and a floating-point tensor is
cast to the model's dtype.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from qtensor.checkpoint.schema import CheckpointError


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}.") from None


def weight_files(d: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a single-file or sharded checkpoint."""
    from safetensors import safe_open

    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index.name} has no weight_map.")
        files = {k: d / v for k, v in weight_map.items()}
    elif (d / "model.safetensors").is_file():
        with safe_open(d / "model.safetensors", "pt") as f:
            files = {k: d / "model.safetensors" for k in f.keys()}
    else:
        raise CheckpointError(
            f"{d} has neither model.safetensors nor model.safetensors.index.json.")
    for path in set(files.values()):
        if not path.is_file():
            raise CheckpointError(f"the index names {path.name}, which is not in {d}.")
    return files


class Reader:
    """Tensors of a checkpoint by name, each file opened once; shapes and dtypes before data."""

    def __init__(self, files: dict[str, Path]):
        self.files, self._open = files, {}
        self._stack = contextlib.ExitStack()

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(path, "pt"))
        return self._open[path]

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        s = self._handle(name).get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def get(self, name: str, device) -> torch.Tensor:
        return self._handle(name).get_tensor(name).to(device)

    def close(self) -> None:
        self._stack.close()


def tied_keys(model: nn.Module) -> set[str]:
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        return set(tied)
    return set()


def set_tensor(model: nn.Module, key: str, value: torch.Tensor, param: bool) -> None:
    """Place `value` as the parameter (frozen) or buffer `key` of the model."""
    owner, _, name = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if param:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


def materialize_buffers(model: nn.Module, device) -> None:
    """Non-persistent buffers (a rotary embedding's frequencies) were built on the meta device
    and are in no checkpoint: recompute them with the model's own initializer, which for a
    module without parameters touches only its buffers."""
    for mname, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set
                 if module._buffers.get(n) is not None]
        if not names:
            continue
        if next(module.parameters(recurse=False), None) is not None:
            raise CheckpointError(
                f"{mname!r} holds parameters and unsaved buffers {names}; qtensor.from_pretrained "
                "cannot rebuild those buffers without re-initializing its weights.")
        for n in names:
            module._buffers[n] = torch.empty_like(module._buffers[n], device=device)
        model._init_weights(module)


def plain_tensors(model: nn.Module, reader: Reader, names: set, quantized: set,
                  used: set) -> dict:
    """{key: model tensor} of the plain tensors to load, after checking them (the module
    docstring's rule). `quantized`: the model keys a quantized tensor replaces; `used`: the
    checkpoint names the quantized tensors were read from."""
    want = dict(model.state_dict(keep_vars=True))  # parameters and persistent buffers
    plain = {k: t for k, t in want.items() if k not in quantized}
    tied = tied_keys(model)
    missing = sorted(k for k in plain if k not in names and k not in tied)
    if missing:
        raise CheckpointError(f"the checkpoint lacks tensors the model needs: {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}.")
    unexpected = sorted(names - used - set(plain))
    if unexpected:
        raise CheckpointError(f"the checkpoint holds tensors the model has no place for: "
                              f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}.")
    for key, t in plain.items():
        if key in names:
            shape, _ = reader.meta(key)
            if shape != tuple(t.shape):
                raise CheckpointError(f"{key!r}: shape {list(shape)} in the checkpoint, "
                                      f"{list(t.shape)} in the model.")
    return {k: t for k, t in plain.items() if k in names}


def place(model: nn.Module, plain: dict, quantized: dict, reader: Reader, device) -> None:
    """Read the plain tensors, then set them and the quantized parameters ({key: tensor},
    frozen) into the model; rebuild unsaved buffers, tie weights, and check nothing is left on
    the meta device."""
    params = dict(model.named_parameters(remove_duplicate=False))
    values = {}
    for key, t in plain.items():
        v = reader.get(key, device)
        if v.is_floating_point() and v.dtype != t.dtype:
            v = v.to(t.dtype)
        values[key] = v
    for key, q in quantized.items():
        set_tensor(model, key, q, param=True)
    for key, v in values.items():
        set_tensor(model, key, v, key in params)
    materialize_buffers(model, device)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"the model still has unloaded tensors after loading: {left[:8]}.")
