"""Quantized tensors under FSDP2 and tensor parallelism.

`fully_shard` is torch's, after a check that names every quantized parameter whose shards
would cut a scale block or split unevenly ([Note: quantized FSDP2 shards] in fsdp.py).
"""

from qtensor.distributed.fsdp import fully_shard, shard_problems

__all__ = ["fully_shard", "shard_problems"]
