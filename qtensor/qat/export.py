"""Export of MXFP4-QAT-trained weights as MXFP4 deployment tensors.

Layout (the packed-blocks + UE8M0-scales layout of MXFP4 checkpoints, e.g. gpt-oss):
    <module>.weight_blocks  uint8 [N, K/32, 16]  two E2M1 codes a byte, element 2j in the low
                                                 nibble, one row of 16 bytes per 1x32 block
    <module>.weight_scales  uint8 [N, K/32]      UE8M0 code e + 127 (value 2**(code - 127))
The codes and exponents come from the same decomposition the QAT forward used
(qtensor.formats.mxfp4.decompose), so the export decodes to exactly the weight training saw.
A weight holding NaN or Inf cannot be deployed and raises, naming the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from qtensor.formats import mxfp4
from qtensor.formats.elements import pack_fp4, unpack_fp4

_BYTES_PER_BLOCK = mxfp4.BLOCK // 2


def export_weight(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [N, K/32, 16], scales uint8 [N, K/32]) of a bf16/fp32 master weight."""
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
        raise TypeError(
            f"MXFP4 export takes a 2-D bf16 or fp32 weight; {name} is {weight.dtype} "
            f"{tuple(weight.shape)}."
        )
    w = weight.detach()
    bad = int((~torch.isfinite(w)).sum())
    if bad:
        raise ValueError(
            f"{name} has {bad} non-finite value(s); an MXFP4 deployment cannot encode NaN or "
            "Inf. Fix the training run (or reload an earlier checkpoint) before exporting."
        )
    codes, e = mxfp4.decompose(w)
    n, k = w.shape
    blocks = pack_fp4(codes).reshape(n, k // mxfp4.BLOCK, _BYTES_PER_BLOCK)
    return blocks.contiguous(), (e + 127).to(torch.uint8)


def decode_weight(blocks: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an MXFP4 deployment decodes [N, K/32, 16] + [N, K/32] to: value(q) * 2**(s-127)."""
    n, nb, _ = blocks.shape
    codes = unpack_fp4(blocks.reshape(n, nb * _BYTES_PER_BLOCK))
    return mxfp4.compose(codes, scales.int() - 127).to(dtype)


def export_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with every MXFP4QATLinear weight replaced by its MXFP4 tensors."""
    from qtensor.qat.linear import MXFP4QATLinear

    out = dict(model.state_dict())
    qat = [name for name, m in model.named_modules() if isinstance(m, MXFP4QATLinear)]
    if not qat:
        raise ValueError(
            "export_state_dict found no MXFP4QATLinear in the model; apply "
            "quantize_(model, MXFP4QATConfig(...)) and train it first."
        )
    modules = dict(model.named_modules())
    for name in qat:
        prefix = f"{name}." if name else ""
        blocks, scales = export_weight(modules[name].weight, f"{prefix}weight")
        del out[f"{prefix}weight"]
        out[f"{prefix}weight_blocks"] = blocks
        out[f"{prefix}weight_scales"] = scales
    return out
