"""Loading state_dicts of quantized models: all-or-nothing, with errors that name the key.

`nn.Module.load_state_dict` copies parameter by parameter, so a mismatch found at the tenth key
leaves nine keys loaded; and its message wraps the tensor's error in a tuple repr. `load_state_dict`
below checks every key first (class, shape, format metadata, inner shapes and dtypes) and only
then hands the state_dict to PyTorch, so a failed load leaves the model untouched.
"""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any, Mapping

import torch
from torch import nn

from qtensor.checkpoint.schema import CheckpointError
from qtensor.tensors import QuantizedTensor
from qtensor.tensors.common import metadata_mismatch


def load(f: str | os.PathLike | Any, map_location=None) -> dict[str, Any]:
    """torch.load with weights_only=True (quantized tensor classes are on the safe list), and
    a clear error when the file asks for any other global."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message leads with generic advice; the line that names the refused global
        # (or opcode) is the one worth showing.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0])
        raise CheckpointError(
            f"{os.fspath(f) if isinstance(f, (str, os.PathLike)) else f!r} is not a weights-only "
            f"checkpoint: {reason}. qtensor never unpickles globals outside torch's allowlist; "
            "load it with weights_only=False only if you trust who wrote it."
        ) from None


def _compare(key: str, dst: torch.Tensor, src: Any, assign: bool) -> str | None:
    """Why `src` cannot be loaded into `dst`, or None."""
    if not isinstance(src, torch.Tensor):
        return f"the checkpoint holds a {type(src).__name__}, not a tensor"
    if src.shape != dst.shape:
        return f"shape {tuple(src.shape)} in the checkpoint, {tuple(dst.shape)} in the model"
    q_dst, q_src = isinstance(dst, QuantizedTensor), isinstance(src, QuantizedTensor)
    if q_src and not q_dst:
        if assign:
            return None  # a high-precision (e.g. meta) model takes the checkpoint's format
        return (f"the checkpoint holds a {type(src).__name__} but the model a high-precision "
                "tensor; quantize_ the model with the checkpoint's config first, or pass "
                "assign=True")
    if q_dst and not q_src:
        return (f"the checkpoint holds a high-precision {src.dtype} tensor but the model a "
                f"{type(dst).__name__}; quantize the checkpoint (it is never quantized "
                "implicitly)")
    if not q_dst:
        return None
    return _compare_quantized(dst, src)


def _compare_quantized(dst: QuantizedTensor, src: QuantizedTensor) -> str | None:
    if type(src) is not type(dst):
        return f"the checkpoint holds a {type(src).__name__}, the model a {type(dst).__name__}"
    differ = metadata_mismatch(dst, src)
    if differ:
        return "format metadata differs (model != checkpoint): " + ", ".join(differ)
    for name in dst.tensor_data_names:
        d, s = getattr(dst, name), getattr(src, name)
        if (d is None) != (s is None):
            return f"inner tensor {name!r} is present on one side only"
        if isinstance(d, QuantizedTensor):  # a part of a composite
            why = _compare_quantized(d, s)
            if why:
                return f"{name} side: {why}"
        elif d is not None and (d.shape != s.shape or d.dtype != s.dtype):
            return (f"inner tensor {name!r} is {s.dtype} {tuple(s.shape)} in the checkpoint, "
                    f"{d.dtype} {tuple(d.shape)} in the model")
    return None


def check_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True, assign: bool = False
) -> None:
    """Raise CheckpointError naming every key that cannot be loaded; change nothing."""
    target = model.state_dict(keep_vars=True)
    problems = []
    if strict:
        missing = [k for k in target if k not in state_dict]
        unexpected = [k for k in state_dict if k not in target]
        problems += [f"{k!r}: missing from the checkpoint" for k in missing]
        problems += [f"{k!r}: not in the model (unexpected key)" for k in unexpected]
    for key, dst in target.items():
        if key in state_dict:
            why = _compare(key, dst, state_dict[key], assign)
            if why:
                problems.append(f"{key!r}: {why}")
    if problems:
        raise CheckpointError(
            f"Cannot load this state_dict into {type(model).__name__} "
            f"({len(problems)} problem(s); the model is unchanged):\n  " + "\n  ".join(problems)
        )


def load_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True, assign: bool = False
):
    """Check every key, then `model.load_state_dict`. With assign=True (a model built on the
    meta device) the checkpoint's tensors become the parameters; quantized ones are frozen
    (requires_grad=False), as quantize_ leaves them."""
    check_state_dict(model, state_dict, strict=strict, assign=assign)
    if assign:
        _refuse_meta_leftovers(model, state_dict)
    # load_state_dict(assign=True) writes a flag into the state_dict's shared _metadata, which
    # would turn a later plain load of the same dict into an assign; give it a private copy.
    sd = dict(state_dict)
    sd = type(state_dict)(sd) if isinstance(state_dict, dict) else sd
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        sd._metadata = copy.deepcopy(metadata)
    result = model.load_state_dict(sd, strict=strict, assign=assign)
    if assign:
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(p, QuantizedTensor) and p.requires_grad:
                    p.requires_grad_(False)
    return result


def _refuse_meta_leftovers(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Before an assign-load into a meta model: a meta tensor of the model that the checkpoint
    does not hold (a non-persistent buffer, such as a rotary embedding's inv_freq, is never
    saved) would stay on the meta device and fail the first forward. Refuse, naming it."""
    if all(getattr(t, "is_meta", True) for t in state_dict.values()):
        return  # a meta checkpoint into a meta model (shape-only loading) is fine
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta and n not in state_dict]
    if left:
        raise CheckpointError(
            f"load_state_dict(assign=True): {left[:8]}{' ...' if len(left) > 8 else ''} "
            f"({len(left)} tensors) are on the meta device and not in the checkpoint "
            "(non-persistent buffers, such as a rotary embedding's inv_freq, are never saved), "
            "so they would stay on meta. Rebuild the modules that own them on the target device "
            "first (for a transformers model, outside the meta context: "
            "model.model.rotary_emb = type(model.model.rotary_emb)(model.config)), then load."
        )
