"""gpt-oss-style MXFP4 checkpoints: `qtensor.from_pretrained` builds the model with each stored
MXFP4 tensor an MXFP4Tensor holding the file's bytes (nothing decoded, nothing re-encoded).

[Note: reading gpt-oss MXFP4 checkpoints]
config.json: `quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`.
Per quantized parameter NAME the checkpoint holds ([Note: MXFP4 storage] in
qtensor/formats/mxfp4.py; docs/formats.md, "MXFP4"):
    NAME_blocks  uint8 [*lead, R, K/32, 16]  E2M1 codes, element 2j in the low nibble
    NAME_scales  uint8 [*lead, R, K/32]      UE8M0 codes c: the block decodes to 2**(c - 127)
a matrix [*lead, R, K] stored with its blocks along K, the reduction dim of the product the
parameter enters:
- an nn.Linear weight [N, K] (F.linear reduces over its last dim) is that matrix as it is
  (qtensor.checkpoint.export_mxfp4 writes these);
- any other parameter is the right operand of `x @ W` (GptOssExperts: `gate_up_proj` [E, H, 2I]
  stored [E, 2I, H], `down_proj` [E, I, H] stored [E, H, I]), so it is the transpose of the
  stored matrix: the MXFP4Tensor is its columnwise view, no byte moved.
The rule is by module, never by shape (a square expert weight, H = I, is still transposed).

Which parameters the config quantizes: the `gate_up_proj` and `down_proj` of every module that
has both (the gpt-oss experts) and every nn.Linear weight, unless `modules_to_not_convert`
names the module; a name is excluded, as transformers' quantizers read that list, when a
pattern matches it as a regex from its start up to a module boundary ("model.layers.*.self_attn"
excludes "model.layers.0.self_attn.q_proj") or when the name ends with the pattern.

Everything is checked before a tensor is placed, each failure a CheckpointError naming the
tensor and the rule (and no model is returned): blocks and scales come in pairs, both uint8,
shapes agree with each other and with the model's parameter, every parameter the config
quantizes is stored quantized and every quantized one is a parameter the config quantizes,
and no block scale is code 255: UE8M0's NaN, which no writer emits for a finite weight (the
exponents of qtensor.formats.mxfp4 stop at code 252) and which would decode its whole block to
NaN. The other tensors load as in every reader (qtensor/checkpoint/model_dir.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qtensor.checkpoint.model_dir import Reader, place, plain_tensors, weight_files
from qtensor.checkpoint.schema import CheckpointError
from qtensor.formats import mxfp4
from qtensor.tensors import MXFP4Tensor

MXFP4_METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_BYTES_PER_BLOCK = mxfp4.BLOCK // 2


def read_excluded(qc: dict) -> list[str]:
    """The validated `modules_to_not_convert` of an mxfp4 quantization_config."""
    patterns = qc.get("modules_to_not_convert") or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise CheckpointError(
            "config.json quantization_config: modules_to_not_convert must be a list of module "
            f"names or patterns; got {patterns!r}.")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise CheckpointError(f"config.json quantization_config: modules_to_not_convert "
                                  f"pattern {p!r} is not a valid regex ({e}).") from None
    return patterns


def converts(name: str, patterns: list[str]) -> bool:
    """Whether module `name` is quantized: no pattern matches it (see the note)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


def _quantized_params(model: nn.Module, quantizes: Callable[[str], bool]) -> dict[str, bool]:
    """{parameter key: whether it is an nn.Linear weight} the config quantizes."""
    out = {}
    for mname, module in model.named_modules():
        if not quantizes(mname):
            continue
        prefix = f"{mname}." if mname else ""
        if isinstance(module, nn.Linear):
            out[f"{prefix}weight"] = True
        elif all(isinstance(module._parameters.get(p), torch.Tensor) for p in EXPERT_PARAMS):
            out.update({f"{prefix}{p}": False for p in EXPERT_PARAMS})
    return out


def _stored_pairs(names: set) -> dict[str, tuple[str, str]]:
    """{parameter key: (blocks name, scales name)}; a half pair raises."""
    bases = {n[: -len(BLOCKS)] for n in names if n.endswith(BLOCKS)} | \
            {n[: -len(SCALES)] for n in names if n.endswith(SCALES)}
    pairs = {}
    for base in sorted(bases):
        b, s = base + BLOCKS, base + SCALES
        if b not in names or s not in names:
            have, lack = (b, s) if b in names else (s, b)
            raise CheckpointError(
                f"{have!r}: has no {lack!r}; an MXFP4 tensor is stored as both its blocks "
                "(packed E2M1 codes) and its scales (UE8M0 codes). Re-export the checkpoint.")
        pairs[base] = (b, s)
    return pairs


def _param_shape(stored: tuple[int, ...], linear: bool) -> tuple[int, ...]:
    return stored if linear else (*stored[:-2], stored[-1], stored[-2])


def _check_pair(key: str, pair: tuple[str, str], reader: Reader, param: torch.Tensor,
                linear: bool) -> None:
    """Dtypes and shapes of one stored pair against each other and the model's parameter."""
    (bshape, bdtype), (sshape, sdtype) = reader.meta(pair[0]), reader.meta(pair[1])
    for name, dtype in ((pair[0], bdtype), (pair[1], sdtype)):
        if dtype != "U8":
            raise CheckpointError(f"{name!r}: MXFP4 blocks and scales are uint8 (U8); got "
                                  f"{dtype}.")
    if len(bshape) < 3 or bshape[-1] != _BYTES_PER_BLOCK or 0 in bshape:
        raise CheckpointError(
            f"{pair[0]!r}: MXFP4 blocks must be [..., R, K/32, {_BYTES_PER_BLOCK}] (16 bytes per "
            f"32-element block); got {list(bshape)}.")
    if sshape != bshape[:-1]:
        raise CheckpointError(
            f"{pair[1]!r}: must be {list(bshape[:-1])}, one UE8M0 code per block of "
            f"{pair[0]!r} {list(bshape)}; got {list(sshape)}.")
    stored = (*bshape[:-2], bshape[-2] * mxfp4.BLOCK)
    want = _param_shape(stored, linear)
    if tuple(param.shape) != want:
        how = ("an nn.Linear weight is stored as it is" if linear else
               "a non-Linear parameter [.., K, N] is stored transposed, [.., N, K]")
        raise CheckpointError(
            f"{pair[0]!r}: holds a matrix {list(stored)}, so the parameter {key!r} would be "
            f"{list(want)} ({how}); the model's is {list(param.shape)}. Check the model config "
            "(hidden_size, intermediate_size, num_local_experts) against the checkpoint.")


def _check_plan(model: nn.Module, quantizes, pairs: dict, reader: Reader) -> dict[str, bool]:
    """{parameter key: is an nn.Linear weight} of the stored pairs, every rule checked."""
    params = dict(model.named_parameters(remove_duplicate=False))
    wanted = _quantized_params(model, quantizes)
    quantizable = set(_quantized_params(model, lambda name: True))  # were nothing excluded
    for key, pair in pairs.items():
        if key not in params:
            raise CheckpointError(f"{pair[0]!r}: {type(model).__name__} has no parameter {key!r} "
                                  "for these MXFP4 tensors.")
        if key not in wanted:
            why = ("modules_to_not_convert names its module" if key in quantizable else
                   "only nn.Linear weights and the experts' gate_up_proj / down_proj are MXFP4")
            raise CheckpointError(f"{pair[0]!r}: the config does not quantize {key!r} ({why}), "
                                  "but the checkpoint holds it quantized.")
        _check_pair(key, pair, reader, params[key], wanted[key])
    missing = sorted(set(wanted) - set(pairs))
    if missing:
        raise CheckpointError(
            f"{missing[0]!r}: the config quantizes this parameter, but the checkpoint has no "
            f"{missing[0] + BLOCKS!r} / {missing[0] + SCALES!r} (add its module to "
            f"modules_to_not_convert if it is stored in high precision; {len(missing)} missing).")
    return {key: wanted[key] for key in pairs}


def _read_scales(pairs: dict, reader: Reader, device) -> dict[str, torch.Tensor]:
    """Every pair's scales, each checked for the NaN code 255 before any model tensor is set."""
    out = {}
    for key, (_, s) in pairs.items():
        scales = reader.get(s, device)
        nan = int((scales == mxfp4.NAN_CODE).sum())
        if nan:
            raise CheckpointError(
                f"{s!r}: {nan} block scale(s) hold code 255, UE8M0's NaN (their blocks would "
                "decode to NaN; no writer emits it for a finite weight). Re-export the weight "
                "from finite values.")
        out[key] = scales
    return out


def load(model: nn.Module, d: Path, quantizes: Callable[[str], bool], device) -> None:
    """Load a gpt-oss MXFP4 checkpoint directory into the meta-built `model` ([Note: reading
    gpt-oss MXFP4 checkpoints])."""
    reader = Reader(weight_files(d))
    try:
        names = set(reader.files)
        pairs = _stored_pairs(names)
        linear = _check_plan(model, quantizes, pairs, reader)
        used = {n for pair in pairs.values() for n in pair}
        plain = plain_tensors(model, reader, names, set(pairs), used)
        params = dict(model.named_parameters(remove_duplicate=False))
        scales = _read_scales(pairs, reader, device)
        quantized = {}
        for key, (b, _) in pairs.items():
            t = MXFP4Tensor.from_bytes(reader.get(b, device), scales[key],
                                       dtype=params[key].dtype)
            quantized[key] = t if linear[key] else t.transpose(-1, -2)
        place(model, plain, quantized, reader, device)
    finally:
        reader.close()
