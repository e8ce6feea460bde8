"""The quantized weight operand, built once per optimizer step and reused across micro-batches.

[Note: weight cache]
Quantizing the weight (two usages, possibly a dequantize-requantize for dgrad_mxfp8) costs as
much as a small GEMM, and the weight only changes at the optimizer step. The cache decides when
to rebuild in one of three ways:

- eager, automatic (`is_first_microbatch=None`): rebuild when the parameter's version counter
  or storage changed. Optimizer steps bump the version counter; writes through `param.data`
  do not (PyTorch does not track them), so call `invalidate()` after such writes.
- eager, explicit (`is_first_microbatch=True/False`): rebuild on True, reuse on False, as
  Transformer Engine's modules take it.
- graph-safe (`skip_update=` a bool tensor on the weight's device): the rebuild always runs and
  writes into the same buffers, each byte chosen on the device by `torch.where(skip_update,
  old, new)`. A CUDA graph captured with this path reuses the first micro-batch's weight on
  every replay where the flag tensor holds True, and the Python side never reads the flag
  (no sync). Gating on the device is what keeps a replay correct: a cache-hit branch that
  rewrote the weight unconditionally would hand a replay that has to reuse the first
  micro-batch's weight a fresh one.

An eager rebuild makes new tensors (never in place), so a backward still holding the previous
operand (saved by an earlier micro-batch) keeps the bytes its forward used.
"""

from __future__ import annotations

from typing import Callable

import torch

from qtensor.tensors import QuantizedTensor


class WeightCache:
    def __init__(self):
        # One operand, or a list of them (one per expert of a grouped linear).
        self.operand: QuantizedTensor | list[QuantizedTensor] | None = None
        self._key: tuple | None = None

    def invalidate(self) -> None:
        self.operand, self._key = None, None

    def get(
        self,
        weight: torch.Tensor,
        build: Callable[[torch.Tensor], QuantizedTensor],
        *,
        is_first_microbatch: bool | None = None,
        skip_update: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """The quantized operand of `weight`, rebuilt only as [Note: weight cache] says."""
        if torch.compiler.is_compiling():
            # Under torch.compile the weight is quantized inside the graph on every call: the
            # cache key (version counter, data pointer) cannot be traced, and the rebuild is
            # bitwise what the cache would hold (weights round to nearest, never stochastically).
            with torch.no_grad():
                return build(weight.detach())
        if skip_update is not None:
            return self._get_graph_safe(weight, build, skip_update)
        key = _key(weight)
        if is_first_microbatch is False and self.operand is None:
            raise RuntimeError(
                "is_first_microbatch=False reuses the cached weight, but nothing is cached yet; "
                "pass True (or None) on the first micro-batch."
            )
        stale = self.operand is None or (is_first_microbatch is None and key != self._key)
        if is_first_microbatch or stale:
            with torch.no_grad():
                self.operand = build(weight.detach())
            self._key = key
        return self.operand

    def _get_graph_safe(self, weight, build, skip_update: torch.Tensor) -> QuantizedTensor:
        if skip_update.dtype != torch.bool or skip_update.numel() != 1:
            raise ValueError(
                f"skip_update must be a one-element bool tensor; got {skip_update.dtype} "
                f"with {skip_update.numel()} elements."
            )
        with torch.no_grad():
            fresh = build(weight.detach())
            if self.operand is None:
                self.operand = fresh
            else:
                gated_copy_(self.operand, fresh, skip_update)
        self._key = _key(weight)
        return self.operand


def _key(weight: torch.Tensor) -> tuple:
    return (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape))


def leaves(t) -> list[torch.Tensor]:
    """The plain inner tensors of a (nested) quantized tensor or a list of them, in order."""
    if isinstance(t, (list, tuple)):
        return [leaf for item in t for leaf in leaves(item)]
    out = []
    for name in t.tensor_data_names:
        inner = getattr(t, name)
        if isinstance(inner, QuantizedTensor):
            out.extend(leaves(inner))
        elif inner is not None:
            out.append(inner)
    return out


def gated_copy_(dst, src, skip: torch.Tensor) -> None:
    """dst's bytes <- src's where skip is False, kept where True; decided on the device."""
    if repr(dst) != repr(src):  # same class, shape and decode metadata, or the bytes mismatch
        raise ValueError(f"gated_copy_ needs matching operands; got {dst!r} and {src!r}.")
    copy_where_(leaves(dst), leaves(src), skip)


# Integer views by element size, so the gate is a bitwise select: torch.where has no float8
# kernels on every backend, and a NaN payload must survive the select bit for bit.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_where_(dsts, srcs, skip: torch.Tensor) -> None:
    """Each dst <- its src where skip is False, kept where True (plain tensors, pairwise);
    the graph-safe gate of both weight caches (this one and qtensor/qat/cache.py)."""
    for d, s in zip(dsts, srcs):
        view = _INT_VIEW[d.element_size()]
        d_bits, s_bits = d.view(view), s.view(view)
        d_bits.copy_(torch.where(skip, d_bits, s_bits))
