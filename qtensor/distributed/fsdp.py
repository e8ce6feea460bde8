"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for quantized parameters.

[Note: quantized FSDP2 shards]
FSDP2 splits each parameter along dim 0 into one equal chunk per rank and, before a module
runs, all-gathers the chunks. A quantized parameter stays quantized on both sides of that:

- *leaves*: the plain inner tensors of a quantized tensor (codes, block scales, a row-scaled
  amax), the two sides of a HybridTensor included. A leaf is either *sharded* along the storage
  dim that carries the tensor's dim 0, or *replicated* (a per-tensor amax; the per-column amax
  of a columnwise row-scaled tensor, which spans all rows), and then every rank holds all of it.
- where dim 0 lives in storage: rowwise NVFP4 and every MXFP8 keep it as storage dim 0 (codes
  [R, C/2], scales [R, C/16] or [R/32, C]); columnwise NVFP4 stores the transpose, so dim 0
  is the packed last storage dim ([C, R/2], [C, R/16]).
- shards follow blocks: a shard's row count must be a multiple of the rows one scale covers
  along dim 0: 16 for NVFP4 16x16 tiles and columnwise NVFP4, 32 for columnwise MXFP8, else 1.
  Dim 0 must split evenly: FSDP2 pads an uneven last shard to the others' size, and padding
  would have to be done inside codes and scales; such a parameter is refused with its name.
- the all-gather: `fsdp_pre_all_gather` hands FSDP2 the sharded leaves (dim 0 first, so the
  gathered tensor is the concatenation), FSDP2 moves them as bytes (it views mixed dtypes as
  uint8), and `fsdp_post_all_gather` rebuilds the full tensor around views of the gathered
  buffers, with the replicated leaves passed on in the metadata. Nothing is dequantized: a
  rowwise NVFP4 weight moves 0.5625 bytes per element (codes 0.5 + scales 0.0625), 0.28x bf16.

Each class answers the questions above through its layout protocol (`shard_dims`,
`block_size`, `parts`: [Note: layout protocol] in qtensor/tensors/base.py); the hooks and the
storage ops FSDP2 calls (`new_zeros`, `as_strided`, `view(-1)`) are written once against it, in
qtensor/tensors/gather.py and qtensor/tensors/layout.py. This module adds `fully_shard` with
the checks up front.
"""

from __future__ import annotations

import torch
from torch import nn

from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.layout import shard_problem


# ---- fully_shard with the checks up front ----------------------------------------------------


def shard_problems(model: nn.Module, world_size: int) -> list[str]:
    """Every quantized parameter of `model` that cannot be dim-0 sharded over world_size."""
    problems = []
    for name, p in model.named_parameters():
        if isinstance(p, QuantizedTensor):
            why = shard_problem(p, p.shape, world_size, name)
            if why:
                problems.append(why)
    return problems


def fully_shard(module: nn.Module, **kwargs):
    """`torch.distributed.fsdp.fully_shard` after checking every quantized parameter's shards.

    Same arguments. The check names each parameter that would be cut mid-block or sharded
    unevenly (torch's own fully_shard finds out only at the first all-gather).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = kwargs.get("mesh")
    if mesh is None:
        device = next((p.device.type for p in module.parameters()), "cpu")
        mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
        kwargs["mesh"] = mesh
    if "shard_placement_fn" in kwargs and kwargs["shard_placement_fn"] is not None:
        raise ValueError(
            "qtensor's fully_shard shards quantized parameters along dim 0 only (blocks run "
            "along the last dim); drop shard_placement_fn or shard this module with torch's "
            "fully_shard and keep quantized parameters out of it."
        )
    problems = shard_problems(module, mesh.size(-1))
    if problems:
        raise ValueError("Cannot fully_shard this module:\n  " + "\n  ".join(problems))
    return torch_fully_shard(module, **kwargs)
