"""Tensor parallelism (torch.distributed.tensor.parallel) for quantized inference weights.

A column-wise plan shards a Linear's weight [N, K] along N (dim 0), a row-wise plan along K
(dim 1, the block dim of a rowwise weight). The DTensor's local tensor is the quantized slice
itself: `torch.chunk` of a quantized tensor keeps its bytes, so each rank slices its part of the
weight it already holds (`src_data_rank=None`: no scatter of quantized bytes is needed, and c10d
has none). Column-wise outputs are exactly the unsharded model's columns; a row-wise layer sums
per-rank partial products, which rounds differently from one K-long sum (the tests bound it).

`parallelize_module` here is torch's after two checks, each naming the parameter:
- a shard must hold whole blocks: N / world_size rows a multiple of 16 for 16x16 tiles, K /
  world_size a multiple of 16 (NVFP4) or 32 (MXFP8);
- weights quantizing their activation (`act_spec`, the dynamic configs) are refused: DTensor
  decomposes F.linear into a matmul of the local shards, which never reaches the F.linear that
  quantizes the activation, and a K-shard of an activation would have another amax anyway.
"""

from __future__ import annotations

from torch import nn

from qtensor.tensors.base import QuantizedTensor


def plan_problems(model: nn.Module, plan: dict, world_size: int) -> list[str]:
    """Why `plan` cannot shard the quantized weights of `model` (empty if it can)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    problems = []
    for path, style in plan.items():
        module = model.get_submodule(path)
        w = getattr(module, "weight", None)
        if not isinstance(w, QuantizedTensor):
            continue
        name = f"{path}.weight ({type(w).__name__}, shape {tuple(w.shape)})"
        if getattr(w, "act_spec", None) is not None:
            problems.append(
                f"{name} quantizes its activation (act_spec={w.act_spec}); under tensor "
                "parallelism F.linear becomes a matmul of local shards that skips it. Use a "
                "weight-only config for tensor-parallel layers."
            )
            continue
        dim = 0 if isinstance(style, ColwiseParallel) else 1 if isinstance(
            style, RowwiseParallel) else None
        if dim is None:
            continue
        size, unit = w.shape[dim], w.block_size(dim)
        if size % world_size or (size // world_size) % unit:
            problems.append(
                f"{name}: {type(style).__name__} splits dim {dim} of {size} into {world_size} "
                f"shards; each must be a multiple of {unit} (its scale blocks). Choose a world "
                "size or layer width that keeps blocks whole, or leave this layer replicated."
            )
    return problems


def parallelize_module(model: nn.Module, device_mesh, plan: dict) -> nn.Module:
    """`torch.distributed.tensor.parallel.parallelize_module` for quantized weights."""
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    problems = plan_problems(model, plan, device_mesh.size())
    if problems:
        raise ValueError("Cannot apply this tensor-parallel plan:\n  " + "\n  ".join(problems))
    return torch_parallelize(model, device_mesh, plan, src_data_rank=None)
