"""Operands by role: quantize a tensor for its role, multiply two operands.

The autograd linear (linear.py) and the grouped linear (grouped.py) are compositions of the
small pieces here; a recipe only chooses the specs ([Note: roles and usages] in recipe.py).

A role's operand is one quantized tensor when only its rowwise usage is needed (the backward
overrides), or a HybridTensor holding both usages, possibly in two formats. A GEMM takes the
side it needs through the HybridTensor slots of qtensor/gemm/dense.py, so the three products are
the same three lines for every recipe:

    fprop(x, w) = x @ w.t()      dgrad(dy, w) = dy @ w      wgrad(dy, x) = dy.t() @ x
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.gemm.dense import quantized_mm, quantized_mm_t
from qtensor.tensors import HybridTensor, NVFP4Tensor, QuantizedTensor, quantize_spec
from qtensor.tensors.hybrid import gradient_cast, is_gradient_cast
from qtensor.tensors.hybrid import SOURCES

Spec = NVFP4Spec | MXFP8Spec | FP8BlockSpec


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """The specs of one role's two usages (None: that usage is not quantized)."""

    rowwise: Spec | None  # blocks along the last dim
    columnwise: Spec | None = None  # blocks along dim 0
    # "original": the columnwise side quantizes the high-precision tensor again;
    # "rowwise_dequantized": it quantizes the rowwise side decoded to the input's dtype.
    columnwise_source: str = "original"

    def __post_init__(self):
        if self.columnwise_source not in SOURCES:
            raise ValueError(
                f"columnwise_source must be one of {SOURCES}; got {self.columnwise_source!r}."
            )
        if self.rowwise is not None and self.rowwise.columnwise:
            raise ValueError(f"The rowwise spec must have columnwise=False; got {self.rowwise}.")
        if self.columnwise is not None and not self.columnwise.columnwise:
            raise ValueError(
                f"The columnwise spec must have columnwise=True; got {self.columnwise}."
            )
        if self.columnwise is not None and self.rowwise is None:
            raise ValueError("A columnwise usage needs a rowwise one (the forward operand).")

    def right_operand(self) -> Spec | None:
        """The usage a GEMM takes as its right operand: the columnwise one, or a rowwise spec of
        128x128 tiles (a square tile serves either side, so one tensor is both usages)."""
        if self.columnwise is None and getattr(self.rowwise, "block", None) == "128x128":
            return self.rowwise
        return self.columnwise


@dataclasses.dataclass(frozen=True)
class OperandSpecs:
    """Specs of the three roles; the GEMM pairs they form are checked at construction."""

    input: RoleSpec
    weight: RoleSpec
    grad_output: RoleSpec
    backward_override: str | None = None

    def __post_init__(self):
        _check_pair("fprop", "input.rowwise", self.input.rowwise, "weight.rowwise",
                    self.weight.rowwise)
        if self.backward_override is not None:
            quantized = (self.input.columnwise, self.weight.columnwise, self.grad_output.rowwise)
            if any(s is not None for s in quantized):
                raise ValueError(
                    f"backward_override={self.backward_override!r} runs the backward in high "
                    "precision; the backward usages (input.columnwise, weight.columnwise, "
                    "grad_output) must be None."
                )
            return
        _check_pair("dgrad", "grad_output.rowwise", self.grad_output.rowwise,
                    "weight.columnwise", self.weight.right_operand())
        _check_pair("wgrad", "grad_output.columnwise", self.grad_output.columnwise,
                    "input.columnwise", self.input.columnwise)

    def role(self, name: str) -> RoleSpec:
        return getattr(self, name)


def _check_pair(gemm: str, name_a: str, a: Spec | None, name_b: str, b: Spec | None) -> None:
    if a is None or b is None:
        missing = name_a if a is None else name_b
        raise ValueError(f"The {gemm} GEMM needs a spec for {missing}; got None.")
    if type(a) is not type(b):
        raise ValueError(
            f"The {gemm} GEMM needs both operands in one format; got {name_a} "
            f"{type(a).__name__} x {name_b} {type(b).__name__}."
        )
    if isinstance(a, NVFP4Spec) and a.rht != b.rht:
        raise ValueError(
            f"The {gemm} GEMM needs RHT on both NVFP4 operands or neither; got {name_a} "
            f"rht={a.rht} x {name_b} rht={b.rht}."
        )


# ---- randomness ------------------------------------------------------------------------------


class SRSeeds:
    """Where a module's stochastic rounding starts: one seed per slot, the state in a tensor.

    The seed of a slot is crc32("{seed}/{index}/{slot}"): deterministic, distinct per module
    (index) and per usage, and independent of whether the other slots round stochastically.
    That is why a recipe whose grad_output rowwise side stops rounding stochastically
    (dgrad_mxfp8) keeps the NVFP4 columnwise (wgrad) bytes of the full NVFP4 recipe bit for bit.

    The module holds the state as an int64 buffer [len(SR_SLOTS), 2] of (seed, offset) rows
    (`initial_state`); each forward that will run a backward takes this step's rows (`advance`)
    and moves every seed on by one in place. The kernels read the rows on the device, so a
    compiled step is one graph with no host sync and no recompilation per step.
    """

    def __init__(self, seed: int = 0, index: int = 0):
        self.seed, self.index = seed, index

    def seed_for(self, slot: str) -> int:
        return zlib.crc32(f"{self.seed}/{self.index}/{slot}".encode())

    def initial_state(self, device=None) -> torch.Tensor:
        """int64 [len(SR_SLOTS), 2]: (slot seed, offset 0) per slot."""
        return torch.tensor([[self.seed_for(slot), 0] for slot in SR_SLOTS], dtype=torch.int64,
                            device=device)


# The slots that may round stochastically: the roles quantized in the training step itself.
SR_SLOTS = ("input.rowwise", "input.columnwise", "grad_output.rowwise", "grad_output.columnwise")


def uses_stochastic_rounding(specs: OperandSpecs) -> bool:
    """Whether any slot of SR_SLOTS rounds stochastically under these specs."""
    return any(getattr(_slot_spec(specs, slot), "stochastic_rounding", False) for slot in SR_SLOTS)


def _slot_spec(specs: OperandSpecs, slot: str) -> Spec | None:
    name, usage = slot.split(".")
    return getattr(specs.role(name), usage)


def advance(state: torch.Tensor, calls: int = 1) -> torch.Tensor:
    """This step's (seed, offset) rows (a copy), then every seed of the module's buffer moves on
    by `calls` in place: call j of the step uses seed + j (`each_call`). mix32 of the seed in
    the bit hash (formats/nvfp4.py sr_bits) makes neighbouring seeds' streams unrelated.

    Compiled, it is the opaque op `qtensor::sr_advance`: written as clone + add_, AOTAutograd's
    partitioner moves the clone (used only by the backward) into the backward graph, where it
    reads the buffer after the forward's in-place advance, and the backward rounds with the
    next step's bits. Eagerly the same two tensor ops run directly: the custom op's Python
    dispatch costs several times the ops themselves on every training linear's forward."""
    if torch.compiler.is_compiling():
        return _advance_op(state, calls)
    return _advance(state, calls)


def _advance(state: torch.Tensor, calls: int) -> torch.Tensor:
    taken = state.clone()
    state.select(1, 0).add_(calls)
    return taken


_advance_op = torch.library.custom_op("qtensor::sr_advance", mutates_args=("state",))(_advance)


@_advance_op.register_fake
def _(state, calls):
    return torch.empty_like(state)


def each_call(states: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The rows of calls 0..n-1 of a step, [n, slots, 2] with seed + j for call j (e.g. expert j
    of a grouped linear): one tensor for all the calls, built on the device in three launches,
    rather than a copy and an add per call (and never a host-to-device copy, which a CUDA graph
    capture could not take)."""
    if states is None:
        return None
    out = states.unsqueeze(0).repeat(n, 1, 1)
    out.select(2, 0).add_(torch.arange(n, device=states.device, dtype=states.dtype)[:, None])
    return out


def sr_for_role(name: str, role: RoleSpec, states: torch.Tensor | None) -> tuple:
    """(rowwise, columnwise) state rows of a role; None for a usage without stochastic rounding."""
    return tuple(
        states[SR_SLOTS.index(f"{name}.{usage}")]
        if states is not None and getattr(spec, "stochastic_rounding", False) else None
        for usage, spec in (("rowwise", role.rowwise), ("columnwise", role.columnwise))
    )


# ---- quantize an operand for its role --------------------------------------------------------


def quantize_rowwise(x: torch.Tensor, role: RoleSpec, name: str, sr=None):
    """The rowwise usage of a 2-D tensor [R, C]; `sr`: its stochastic-rounding state row
    (sr_for_role), an SRSeed, or a generator (eager only)."""
    return _quantize(x, role.rowwise, name, "rowwise", sr)


def quantize_role(x: torch.Tensor, role: RoleSpec, name: str, sr=(None, None),
                  rowwise: QuantizedTensor | None = None):
    """A 2-D tensor [R, C] quantized for its role: one tensor, or a HybridTensor of both usages.

    `rowwise` passes a rowwise side quantized earlier (a row-scaled activation quantized once
    for all experts and sliced); it must be what `quantize_rowwise` would return.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_role takes a 2-D tensor; got shape {tuple(x.shape)}.")
    if rowwise is None and is_gradient_cast(role.rowwise, role.columnwise, role.columnwise_source):
        # grad_output of dgrad_mxfp8: one read writes both usages (MXFP8 rows, NVFP4 columns).
        row, col = _with_context(gradient_cast, name, "hybrid", x, role.rowwise, role.columnwise,
                                 sr[1])
        return HybridTensor(x.shape, x.dtype, x.device, rowwise=row, columnwise=col,
                            columnwise_source=role.columnwise_source)
    row = rowwise if rowwise is not None else quantize_rowwise(x, role, name, sr[0])
    if role.columnwise is None:
        return row
    src = row.dequantize(x.dtype) if role.columnwise_source == "rowwise_dequantized" else x
    col = _quantize(src, role.columnwise, name, "columnwise", sr[1], _shared_amax(row, role))
    return HybridTensor(x.shape, x.dtype, x.device, rowwise=row, columnwise=col,
                        columnwise_source=role.columnwise_source)


def _quantize(x, spec, name, usage, sr, amax=None):
    # Not checked for NaN/Inf: the check costs a device sync per operand; a non-finite
    # value poisons its amax and decodes to NaN, which the loss then shows.
    if amax is not None:
        return _with_context(NVFP4Tensor.from_spec, name, usage, x, spec, generator=sr,
                             check_finite=False, global_amax=amax)
    return _with_context(quantize_spec, name, usage, x, spec, generator=sr, check_finite=False)


def _shared_amax(row, role: RoleSpec) -> torch.Tensor | None:
    """The rowwise side's amax where the columnwise cast of the same tensor would compute the
    same one, else None. Without RHT or row scaling an NVFP4 amax is max |x| over every element,
    whichever way the blocks run (every backend reduces it with the same code for both
    directions), so the second amax pass over x is skipped: a weight's two usages, and every
    role of the recipes without RHT."""
    col = role.columnwise
    if role.columnwise_source != "original" or not isinstance(row, NVFP4Tensor) or \
            not isinstance(role.rowwise, NVFP4Spec) or not isinstance(col, NVFP4Spec):
        return None
    if role.rowwise.rht or col.rht or role.rowwise.row_scaled or col.row_scaled:
        return None
    return row.amax


def _with_context(fn, name, usage, x, *args, **kwargs):
    """fn(x, ...) with a shape error restated for a training linear's operand."""
    try:
        return fn(x, *args, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"Cannot quantize the {name} {usage} operand of shape {tuple(x.shape)}: {err} "
            "A training linear needs in/out features divisible by 16 (32 for MXFP8 usages) "
            "and, for a quantized backward, token counts divisible by 16 (32 for MXFP8 "
            "columnwise): pad the batch (per expert for a grouped linear) or exclude the layer."
        ) from None


# ---- multiply two operands -------------------------------------------------------------------


def fprop(x_op, w_op, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Y [M, N] = X [M, K] @ W [N, K]^T (+ bias): input rowwise x weight rowwise."""
    return quantized_mm_t(x_op, w_op, bias, out_dtype=out_dtype, b_t=True)


def dgrad(dy_op, w_op, out_dtype: torch.dtype) -> torch.Tensor:
    """dX [M, K] = dY [M, N] @ W [N, K]: grad_output rowwise x weight columnwise."""
    return quantized_mm(dy_op, w_op, out_dtype=out_dtype)


def wgrad(dy_op, x_op, out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] = dY [M, N]^T @ X [M, K]: grad_output columnwise x input columnwise."""
    return quantized_mm_t(dy_op, x_op, out_dtype=out_dtype, a_t=True)
