"""The weight cache of an MXFP4QATLinear: convert once per optimizer step, reuse per micro-batch.

[Note: weight cache and CUDA graphs]
An entry holds the host operands of the weight (fprop, and dgrad when the backward is
quantized) in buffers that live as long as the entry, so a captured CUDA graph keeps pointing
at them. Three paths:
- miss: no entry, or its key changed (config, GEMM backend, shape, dtype, device or storage of
  the weight: a recipe switch invalidates): convert into freshly allocated buffers.
- hit: `is_first_microbatch=False`, or the weight's version counter has not moved: reuse.
- update: the weight changed (or `is_first_microbatch=True`): convert and copy into the SAME
  buffers. With `skip_update` (a 0-d bool tensor) the copy is gated on the device,
  `buf = where(skip_update, buf, new)`, and always taken: inside a graph the Python branch is
  frozen at capture, so only a device-side gate can keep a replay from overwriting the first
  micro-batch's weight. The gate covers both conversion modes alike: a direct conversion
  without it would overwrite that weight on every replay.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from qtensor.backends import GemmBackend
from qtensor.qat import kernels
from qtensor.qat.hosts import Host, Operand
from qtensor.training.weight_cache import copy_where_


@dataclasses.dataclass
class WeightOperands:
    fwd: Operand  # [N, K], blocks along K (mx_row) or 128x128 tiles
    dgrad: Operand | None  # [N, K], blocks along N (mx_col) or tiles; None if not needed
    backend: GemmBackend

    def tensors(self) -> list[torch.Tensor]:
        ops = [self.fwd] + ([self.dgrad] if self.dgrad is not None else [])
        return [t for op in ops for t in op.tensors()]


def convert_weight(weight: torch.Tensor, config, backend: GemmBackend) -> WeightOperands:
    """The weight's host operands under `config` (projection or direct; fused kernel if built)."""
    w = weight.detach()
    host, direct = Host(config.host), config.direct
    need_dgrad = config.backward_override is None
    if host is Host.MXFP8:
        row, col = kernels.mxfp4_qat_mxfp8(w, direct, rowwise=True, columnwise=need_dgrad)
        fwd = Operand(*row, "mx_row")
        dgrad = Operand(*col, "mx_col") if need_dgrad else None
        return WeightOperands(fwd, dgrad, backend)
    fwd = Operand(*kernels.mxfp4_qat_fp8_block(w, direct), "fb_tile")
    dgrad = None
    if need_dgrad:
        # The dgrad GEMM reads the tiles as a column-major right operand: keep that exact
        # transpose of the bytes cached rather than transposing on every backward.
        native = backend is GemmBackend.SCALED_MM
        q = fwd.qdata.t().contiguous().t() if native else fwd.qdata
        dgrad = Operand(q, fwd.scale, "fb_tile")
    return WeightOperands(fwd, dgrad, backend)


def _key(weight: torch.Tensor, config, backend: GemmBackend):
    return (config.host, config.direct, config.backward_override, backend, tuple(weight.shape),
            weight.dtype, weight.device, weight.untyped_storage().data_ptr())


class WeightCache:
    def __init__(self):
        self.key = None
        self.version = None
        self.operands: WeightOperands | None = None
        self.stats: Counter = Counter()  # "miss", "hit", "update", "gated_update"

    def invalidate(self) -> None:
        self.key = self.version = self.operands = None

    def get(self, weight, config, backend, is_first_microbatch=None, skip_update=None):
        _check_skip_update(skip_update, weight)
        if torch.compiler.is_compiling():
            # Compiled steps convert the weight inside the graph on every call: the cache key
            # (storage pointer, version counter) cannot be traced; the bytes are the same.
            return convert_weight(weight, config, backend)
        key = _key(weight, config, backend)
        if self.operands is None or key != self.key:
            self.stats["miss"] += 1
            self.key, self.operands = key, convert_weight(weight, config, backend)
        elif skip_update is not None:
            self.stats["gated_update"] += 1
            self._copy(convert_weight(weight, config, backend), skip_update)
        elif is_first_microbatch is False or (
            is_first_microbatch is None and weight._version == self.version
        ):
            self.stats["hit"] += 1
        else:
            self.stats["update"] += 1
            self._copy(convert_weight(weight, config, backend), None)
        self.version = weight._version
        return self.operands

    def _copy(self, new: WeightOperands, skip_update: torch.Tensor | None) -> None:
        if skip_update is not None:
            copy_where_(self.operands.tensors(), new.tensors(), skip_update)
            return
        for buf, src in zip(self.operands.tensors(), new.tensors()):
            buf.copy_(src)


def _check_skip_update(skip_update, weight) -> None:
    if skip_update is None:
        return
    if not isinstance(skip_update, torch.Tensor) or skip_update.dtype != torch.bool or (
        skip_update.dim() != 0 or skip_update.device != weight.device
    ):
        got = (f"{skip_update.dtype} {tuple(skip_update.shape)} on {skip_update.device}"
               if isinstance(skip_update, torch.Tensor) else type(skip_update).__name__)
        raise TypeError(
            f"skip_update must be a 0-d bool tensor on the weight's device ({weight.device}) so "
            f"a CUDA graph can gate the cache rewrite on the device; got {got}."
        )
