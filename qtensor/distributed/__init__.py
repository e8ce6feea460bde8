"""Quantized tensors under FSDP2 and tensor parallelism.

- `fully_shard`: torch's, after a check that names every quantized parameter whose shards
  would cut a scale block or split unevenly ([Note: quantized FSDP2 shards] in fsdp.py).
- `quantize_on_gather`, `precompute_amaxes`: FSDP2 training with the NVFP4 recipe, high-
  precision master shards all-gathered as quantized operands ([Note: quantize before the
  all-gather] in master.py).
- `parallelize_module`, `plan_problems`: tensor-parallel plans over quantized weights (tp.py).
"""

from qtensor.distributed.fsdp import fully_shard, shard_problems
from qtensor.distributed.tp import parallelize_module, plan_problems

_MASTER = {"QuantizeOnGatherWeight", "precompute_amaxes", "quantize_on_gather"}


def __getattr__(name):
    if name in _MASTER:  # imports torch.distributed and qtensor.training: on first use
        from qtensor.distributed import master

        return getattr(master, name)
    raise AttributeError(f"module 'qtensor.distributed' has no attribute {name!r}")


__all__ = ["QuantizeOnGatherWeight", "fully_shard", "parallelize_module", "plan_problems",
           "precompute_amaxes", "quantize_on_gather", "shard_problems"]
