"""Helpers for qtensor's own tests, examples and the GPU check, not part of the library API.

- `launch`: `run_local(fn, world_size)` runs a function on N spawned local ranks; `drain()` and
  `free_port()` for scripts that spawn their own ranks.
- `collectives`: `CollectiveCounter` counts the bytes a torch.distributed collective moves;
  `gather_report(model)` the bytes each FSDP module's all-gather moves against bf16.
"""
