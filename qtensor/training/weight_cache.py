"""The quantized weight operand, built once per optimizer step and reused across micro-batches.

[Note: weight cache]
Quantizing the weight (two usages, possibly a dequantize-requantize for dgrad_mxfp8, or the
MXFP4 projection of QAT) costs as much as a small GEMM, and the weight only changes at the
optimizer step. The cache decides when to rebuild in one of three ways:

- eager, automatic (`is_first_microbatch=None`): rebuild when the parameter's version counter
  or storage changed. Optimizer steps bump the version counter; writes through `param.data`
  do not (PyTorch does not track them), so call `invalidate()` after such writes.
- eager, explicit (`is_first_microbatch=True/False`): rebuild on True, reuse on False, as
  Transformer Engine's modules take it. False on an empty cache raises (`strict_reuse=True`,
  the training modules) or builds (`strict_reuse=False`, MXFP4QATLinear, whose documented
  behaviour is to convert then).
- graph-safe (`skip_update=` a bool tensor on the weight's device): the rebuild always runs and
  writes into the same buffers, each byte chosen on the device by `torch.where(skip_update,
  old, new)`. A CUDA graph captured with this path reuses the first micro-batch's weight on
  every replay where the flag tensor holds True, and the Python side never reads the flag
  (no sync). Gating on the device is what keeps a replay correct: a cache-hit branch that
  rewrote the weight unconditionally would hand a replay that has to reuse the first
  micro-batch's weight a fresh one.

Whatever the mode, a change of `key` (what `build` depends on besides the weight: a QAT config
and its GEMM backend, so a recipe switch invalidates) or of the weight's shape, dtype or device
builds a fresh entry. An eager rebuild makes new tensors (never in place), so a backward still
holding the previous operand (saved by an earlier micro-batch) keeps the bytes its forward used.
`stats` counts the paths taken: "miss" (fresh entry), "hit", "update" (eager rebuild),
"gated_update" (graph-safe rebuild).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable

import torch

from qtensor.tensors import QuantizedTensor
from qtensor.training.experts import ExpertStack


class WeightCache:
    def __init__(self, strict_reuse: bool = True):
        # One operand, or a grouped linear's experts' operands.
        self.operand: QuantizedTensor | ExpertStack | None = None
        self.strict_reuse = strict_reuse
        self.stats: Counter = Counter()
        self._key: tuple | None = None  # staleness: version counter and storage
        self._entry: tuple | None = None  # identity: build key, shape, dtype, device

    def invalidate(self) -> None:
        self.operand, self._key, self._entry = None, None, None

    def get(
        self,
        weight: torch.Tensor,
        build: Callable[[torch.Tensor], QuantizedTensor],
        *,
        key: Hashable = (),
        is_first_microbatch: bool | None = None,
        skip_update: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """The quantized operand of `weight`, rebuilt only as [Note: weight cache] says."""
        check_skip_update(skip_update, weight)
        if torch.compiler.is_compiling():
            # Under torch.compile the weight is quantized inside the graph on every call: the
            # cache key (version counter, data pointer) cannot be traced, and the rebuild is
            # bitwise what the cache would hold (weights round to nearest, never stochastically).
            with torch.no_grad():
                return build(weight.detach())
        entry = (key, tuple(weight.shape), weight.dtype, weight.device)
        if self.operand is not None and entry != self._entry:
            self.invalidate()
        if is_first_microbatch is False and self.operand is None and skip_update is None and \
                self.strict_reuse:
            raise RuntimeError(
                "is_first_microbatch=False reuses the cached weight, but nothing is cached yet; "
                "pass True (or None) on the first micro-batch."
            )
        if self.operand is None:
            self.stats["miss"] += 1
            self._store(weight, _build(build, weight), entry)
        elif skip_update is not None:
            self.stats["gated_update"] += 1
            gated_copy_(self.operand, _build(build, weight), skip_update)
            self._key = _key(weight)
        elif is_first_microbatch or (is_first_microbatch is None and _key(weight) != self._key):
            self.stats["update"] += 1
            self._store(weight, _build(build, weight), entry)
        else:
            self.stats["hit"] += 1
        return self.operand

    def _store(self, weight, operand, entry) -> None:
        self.operand, self._key, self._entry = operand, _key(weight), entry


def _build(build, weight: torch.Tensor):
    with torch.no_grad():
        return build(weight.detach())


def check_skip_update(skip_update, weight: torch.Tensor) -> None:
    """Raise unless skip_update is None or a one-element bool tensor on the weight's device (a
    flag elsewhere could not gate the rewrite on the device inside a CUDA graph)."""
    if skip_update is None:
        return
    need = (f"skip_update must be a 0-d bool tensor (a one-element bool tensor) on the weight's "
            f"device ({weight.device}) so a CUDA graph can gate the cache rewrite on the device")
    if not isinstance(skip_update, torch.Tensor):
        raise TypeError(f"{need}; got {type(skip_update).__name__}. Pass torch.tensor(flag, "
                        "device=weight.device).")
    if skip_update.dtype != torch.bool or skip_update.numel() != 1 or (
            skip_update.device != weight.device):
        raise ValueError(f"{need}; got {skip_update.dtype} with {skip_update.numel()} elements "
                         f"on {skip_update.device}.")


def _key(weight: torch.Tensor) -> tuple:
    return (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape))


def leaves(t) -> list[torch.Tensor]:
    """The plain inner tensors of a (nested) quantized tensor or a list of them, in order."""
    if isinstance(t, (list, tuple)):
        return [leaf for item in t for leaf in leaves(item)]
    if isinstance(t, ExpertStack):
        return leaves(t.tensors())
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
    """Each dst <- its src where skip is False, kept where True (plain tensors, pairwise)."""
    for d, s in zip(dsts, srcs):
        view = _INT_VIEW[d.element_size()]
        d_bits, s_bits = d.view(view), s.view(view)
        d_bits.copy_(torch.where(skip, d_bits, s_bits))
