"""Run a function on N local ranks: the harness of the distributed tests and the GPU check.

`run_local(fn, world_size)` spawns `world_size` processes on this machine, joins them into one
process group over 127.0.0.1 (gloo on the CPU, NCCL with one GPU per rank), calls
`fn(rank, world_size, *args)` in each, and returns the ranks' return values in rank order.
`fn` must be importable by name (a module-level function), as spawned processes unpickle it.
A rank that raises makes `run_local` raise with that rank's traceback.

`drain()` ends a rank's work cleanly (see there); scripts that spawn their own ranks call it
before `destroy_process_group`.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, backend, port, out_dir, fn, args, timeout):
    import torch.distributed as dist

    # One intra-op thread per rank: ranks share the machine's cores, and oversubscribing
    # them slows gloo collectives by an order of magnitude on a 2-core runner.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        try:
            drain()
        except RuntimeError:  # a peer failed and left the group: report its error, not ours
            pass
    finally:
        dist.destroy_process_group()


def drain() -> None:
    """Let every collective of this rank finish and be freed before the process exits.

    A finished gloo work item (FSDP2's all-gathers) is freed on gloo's worker thread and holds
    tensors with Python objects; freeing one while the interpreter finalizes aborts the process
    (`terminate called without an active exception`). Collecting fn's garbage frees the work
    handles now, and the barrier queues behind every earlier collective, so destroying the group
    afterwards joins idle worker threads."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()


def run_local(fn: Callable, world_size: int = 2, *args, backend: str = "gloo",
              timeout: datetime.timedelta | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` spawned ranks; their results, rank order.
    `timeout` is the process group's (torch's default when None)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl'; got {backend!r}.")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"NCCL with {world_size} ranks needs {world_size} GPUs; this machine has "
            f"{torch.cuda.device_count()}."
        )
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, backend, free_port(), out_dir, fn, args, timeout),
                 nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
                for r in range(world_size)]
