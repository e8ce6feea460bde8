"""Count what FSDP2's all-gathers move: the bytes of each collective's input, per rank.

FSDP2 (`torch.distributed.fsdp.fully_shard`) all-gathers the shards of one FSDP module's
parameters in one call of `torch.distributed.all_gather_single` (`all_gather_into_tensor` in
older torch), after viewing the inputs as uint8 bytes when their dtypes differ (mixed codes and
scales). `CollectiveCounter` wraps such a function for the duration of a `with` block and
records each call's (input dtype, input bytes): the rank's share of what the collective moves.
The bytes are the shards' bytes, so they do not depend on the backend or the device: gloo on
the CPU moves what NCCL moves on GPUs, and a CPU test can assert them.

`gather_report(model)` unshards every FSDP module of a sharded model once inside a counter (the
public `FSDPModule.unshard` / `reshard`) and gives per module the bytes its all-gather moved
against what the same parameters move in bf16 (2 bytes per element): the ratio the FSDP2
docs report (docs/fsdp2.md). A module whose weight is a `QuantizeOnGatherWeight` needs
`precompute_amaxes(model)` first, as for a forward.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

# The collective FSDP2's default all-gather calls, by torch version.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else (
    "all_gather_into_tensor")


class CollectiveCounter:
    """`with CollectiveCounter(name, arg) as c:` records (dtype, bytes) of the tensor argument
    `arg` of every call of `torch.distributed.<name>` in `c.calls`."""

    def __init__(self, name: str = ALL_GATHER, arg: int = 1):
        if not hasattr(dist, name):
            raise ValueError(f"torch.distributed has no collective {name!r} to count.")
        self.name, self.arg = name, arg
        self.calls: list[tuple[torch.dtype, int]] = []

    @property
    def bytes(self) -> list[int]:
        return [n for _, n in self.calls]

    def __enter__(self) -> "CollectiveCounter":
        self.original = getattr(dist, self.name)

        def counted(*args, **kwargs):
            t = args[self.arg]
            self.calls.append((t.dtype, t.numel() * t.element_size()))
            return self.original(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc) -> None:
        setattr(dist, self.name, self.original)


@dataclasses.dataclass(frozen=True)
class GatherRow:
    module: str  # the FSDP module's name in the model ("" for the root)
    params: tuple[str, ...]  # the parameters its all-gather carries (names inside the module)
    moved: int  # bytes this rank's all-gather input held
    bf16: int  # bytes the same shards hold in bf16

    @property
    def ratio(self) -> float:
        return self.moved / self.bf16


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters one FSDP module all-gathers: its own, not those of nested FSDP modules."""
    from torch.distributed.fsdp import FSDPModule

    out = []

    def walk(m: nn.Module, prefix: str):
        out.extend((prefix + n, p) for n, p in m.named_parameters(recurse=False))
        for name, child in m.named_children():
            if not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return out


def gather_report(model: nn.Module) -> list[GatherRow]:
    """Per FSDP module of `model` (collective: every rank calls it), the bytes one all-gather
    of its parameters moves from this rank, next to bf16's."""
    from torch.distributed.fsdp import FSDPModule

    world = dist.get_world_size()
    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        params = own_parameters(module)
        if not params:
            continue
        with CollectiveCounter() as counter:
            module.unshard()
        module.reshard()
        rows.append(GatherRow(name, tuple(n for n, _ in params), sum(counter.bytes),
                              sum(2 * p.numel() // world for _, p in params)))
    return rows


def format_report(rows: list[GatherRow]) -> str:
    """A markdown table of a gather report, with the total."""
    lines = ["| FSDP module | parameters | bytes per rank | bf16 bytes | vs bf16 |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.module or '(root)'} | {', '.join(r.params)} | {r.moved:,} | "
                     f"{r.bf16:,} | {r.ratio:.3f} |")
    moved, bf16 = sum(r.moved for r in rows), sum(r.bf16 for r in rows)
    lines.append(f"| total | | {moved:,} | {bf16:,} | {moved / bf16:.3f} |")
    return "\n".join(lines)
