"""The NVFP4 training recipe: one frozen dataclass, validated at construction.

[Note: roles and usages]
A linear layer multiplies three tensors in three GEMMs. Each tensor has a role (input, weight,
grad_output) and is needed in up to two usages: rowwise (blocks along its last dim, a left GEMM
operand) and columnwise (blocks along dim 0, a right operand):

    fprop  Y  = X  @ W^T    input.rowwise       x weight.rowwise
    dgrad  dX = dY @ W      grad_output.rowwise x weight.columnwise
    wgrad  dW = dY^T @ X    grad_output.columnwise x input.columnwise

The recipe decides one spec per (role, usage) in `operand_specs()`; the autograd linear only
quantizes operands for their roles and multiplies them (qtensor/training/roles.py). Defaults
follow Transformer Engine's NVFP4BlockScaling: 2D weight tiles, RHT on the wgrad operands and
stochastic rounding of gradients, 4over6 off. docs/training.md has the table of knobs, their
QTENSOR_* variables and Transformer Engine's names for them.

[Note: renamed recipe fields]
Three 4over6 fields were renamed so that a scope of roles reads as one: `fourover6` is now
`fourover6_roles`, `fourover6_err` is `fourover6_error`, `fourover6_e4m3_256` is
`fourover6_e4m3_256_roles` (`fourover6_grad` is a flag and keeps its name). For one release the
old names still work wherever a recipe is built or read: as constructor keywords (so
`from_env` overrides and torchao's `config_from_dict` of a config saved with the old keys), as
attributes, and in pickles written before the rename. Each use raises a DeprecationWarning that
names the new field; giving an old name and its new one together is a TypeError. The one place
they do not work is `dataclasses.replace(recipe, fourover6=...)`: replace passes every field by
its new name, so an old one always collides (the TypeError says to use the new name).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Literal, Mapping

from qtensor.backends import env
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.training.roles import OperandSpecs, RoleSpec

Scope = Literal["none", "weights", "activations", "all"]
BackwardOverride = Literal["high_precision", "dequantized"]
SCOPES = ("none", "weights", "activations", "all")
ERR_MODES = ("mae", "mse")
OVERRIDES = (None, "high_precision", "dequantized")

# Deprecated field name -> its new name ([Note: renamed recipe fields]).
RENAMED_FIELDS = {
    "fourover6": "fourover6_roles",
    "fourover6_err": "fourover6_error",
    "fourover6_e4m3_256": "fourover6_e4m3_256_roles",
}


def _deprecated(old: str, stacklevel: int) -> None:
    warnings.warn(f"NVFP4TrainingRecipe.{old} is deprecated and goes in the next release; use "
                  f"{RENAMED_FIELDS[old]}.", DeprecationWarning, stacklevel=stacklevel + 1)


def _renamed(fields: Mapping, stacklevel: int) -> dict:
    """`fields` with each deprecated name replaced by its new one, warning once per name.
    `stacklevel` is warnings.warn's, counted from the caller of this function."""
    out = dict(fields)
    for old, new in RENAMED_FIELDS.items():
        if old not in out:
            continue
        if new in out:
            raise TypeError(
                f"NVFP4TrainingRecipe got both {old}={out[old]!r} (deprecated) and "
                f"{new}={out[new]!r}, which name the same field; pass only {new}. "
                f"(dataclasses.replace passes every field by its new name: replace {new}.)"
            )
        _deprecated(old, stacklevel + 1)
        out[new] = out.pop(old)
    return out


def _accepts_renamed_fields(cls):
    """Wraps the dataclass __init__ to accept the deprecated keywords, and adds read-only
    properties under the deprecated names."""
    dataclass_init = cls.__init__

    @functools.wraps(dataclass_init)
    def __init__(self, *args, **kwargs):
        dataclass_init(self, *args, **_renamed(kwargs, stacklevel=2))

    def alias(old: str, new: str) -> property:
        def get(self):
            _deprecated(old, stacklevel=2)
            return getattr(self, new)

        return property(get, doc=f"Deprecated name of {new}.")

    cls.__init__ = __init__
    for old, new in RENAMED_FIELDS.items():
        setattr(cls, old, alias(old, new))
    return cls


@_accepts_renamed_fields
@dataclasses.dataclass(frozen=True)
class NVFP4TrainingRecipe:
    """NVFP4 forward, NVFP4 (or MXFP8-dgrad, or high-precision) backward."""

    # 16x16 weight tiles: the weight's rowwise and columnwise bytes are then transposes, so
    # fprop and dgrad see the same quantized weight.
    weight_2d: bool = True
    # Random Hadamard transform of the two wgrad operands (input and grad_output columnwise).
    rht: bool = True
    # Stochastic rounding of grad_output's NVFP4 codes (both usages); unbiased gradients.
    stochastic_rounding: bool = True
    # One amax per token for the input (per column for its wgrad operand), so one outlier
    # token does not flatten the other tokens' scales; excludes RHT, 2D and SR.
    row_scaled_activation: bool = False
    # Which forward roles choose map-to-4 vs map-to-6 per block (4over6, arXiv 2512.02010).
    fourover6_roles: Scope = "none"
    # Error that picks the 4over6 candidate: mean absolute ("mae") or squared ("mse").
    fourover6_error: str = "mae"
    # Roles whose 4over6 tensors use E4M3 bound 256 (so the largest block's map-to-4 scale is
    # 384, exact) instead of 448. Gradients follow "all".
    fourover6_e4m3_256_roles: Scope = "all"
    # 4over6 for both usages of grad_output (needs rht=False and stochastic_rounding=False).
    fourover6_grad: bool = False
    # dgrad on MXFP8 operands: weight = NVFP4 rowwise + MXFP8 columnwise requantized from the
    # dequantized NVFP4 weight; grad_output = MXFP8 rowwise + NVFP4 columnwise. It cuts the
    # NVFP4 backward's gradient error by about a third (0.239 to 0.163, the gradient-error table
    # of docs/training.md); fprop and wgrad are unchanged.
    dgrad_mxfp8: bool = False
    # None: quantized backward. "high_precision": both backward GEMMs in the compute dtype on
    # the original input and weight. "dequantized": on the dequantized forward operands.
    backward_override: BackwardOverride | None = None
    # Base seed of the stochastic-rounding state (docs/training.md, "Randomness").
    seed: int = 0

    def __post_init__(self):
        _check_choice("fourover6_roles", self.fourover6_roles, SCOPES)
        _check_choice("fourover6_e4m3_256_roles", self.fourover6_e4m3_256_roles, SCOPES)
        _check_choice("fourover6_error", self.fourover6_error, ERR_MODES)
        _check_choice("backward_override", self.backward_override, OVERRIDES)
        for name in ("weight_2d", "rht", "stochastic_rounding", "row_scaled_activation",
                     "fourover6_grad", "dgrad_mxfp8"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}.")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {self.seed!r}.")
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.dgrad_mxfp8 and self.backward_override is not None:
            raise ValueError(
                f"dgrad_mxfp8=True quantizes the dgrad operands to MXFP8, but "
                f"backward_override={self.backward_override!r} replaces the quantized backward; "
                "set one of them, not both."
            )
        if self.fourover6_grad and (self.rht or self.stochastic_rounding):
            raise ValueError(
                f"fourover6_grad=True needs rht=False and stochastic_rounding=False (4over6 "
                f"compares deterministic codes of untransformed blocks); got rht={self.rht}, "
                f"stochastic_rounding={self.stochastic_rounding}."
            )
        if self.row_scaled_activation and (self.rht or self.weight_2d or self.stochastic_rounding):
            raise ValueError(
                "row_scaled_activation=True needs rht=False, weight_2d=False and "
                "stochastic_rounding=False (the per-token amax is defined on untransformed 1x16 "
                f"blocks); got rht={self.rht}, weight_2d={self.weight_2d}, "
                f"stochastic_rounding={self.stochastic_rounding}."
            )
        if self.fourover6_roles in ("activations", "all") and self.rht:
            raise ValueError(
                f"fourover6_roles={self.fourover6_roles!r} applies 4over6 to the input's wgrad "
                "operand, which rht=True transforms; 4over6 excludes RHT. Set rht=False or "
                "fourover6_roles='weights'."
            )

    # ---- per-role choices --------------------------------------------------------------------

    def fourover6_for(self, role: str) -> str | None:
        """The 4over6 error mode of a role's NVFP4 operands, or None."""
        if role == "grad_output":
            return self.fourover6_error if self.fourover6_grad else None
        return self.fourover6_error if _in_scope(self.fourover6_roles, role) else None

    def e4m3_bound_for(self, role: str) -> int:
        """E4M3 bound B: 256 only for 4over6 operands of a role in the 256 scope."""
        if self.fourover6_for(role) is None:
            return 448
        if role == "grad_output":
            return 256 if self.fourover6_e4m3_256_roles == "all" else 448
        return 256 if _in_scope(self.fourover6_e4m3_256_roles, role) else 448

    def nvfp4_spec(self, role: str, columnwise: bool) -> NVFP4Spec:
        """The NVFP4 spec of one (role, usage)."""
        grad = role == "grad_output"
        return NVFP4Spec(
            block_2d=self.weight_2d and role == "weight",
            row_scaled=self.row_scaled_activation and role == "input",
            fourover6=self.fourover6_for(role),
            e4m3_bound=self.e4m3_bound_for(role),
            rht=self.rht and columnwise and role != "weight",
            stochastic_rounding=self.stochastic_rounding and grad,
            columnwise=columnwise,
        )

    def operand_specs(self) -> OperandSpecs:
        """What each role is quantized to, per usage: the whole recipe as data."""
        x_row, w_row = self.nvfp4_spec("input", False), self.nvfp4_spec("weight", False)
        if self.backward_override is not None:
            # Only the forward operands are quantized; the backward runs in high precision.
            return OperandSpecs(
                input=RoleSpec(x_row), weight=RoleSpec(w_row), grad_output=RoleSpec(None),
                backward_override=self.backward_override,
            )
        x = RoleSpec(x_row, self.nvfp4_spec("input", True))
        dy_col = self.nvfp4_spec("grad_output", True)
        if self.dgrad_mxfp8:
            w = RoleSpec(w_row, MXFP8Spec(columnwise=True), "rowwise_dequantized")
            dy = RoleSpec(MXFP8Spec(), dy_col)
        else:
            w = RoleSpec(w_row, self.nvfp4_spec("weight", True))
            dy = RoleSpec(self.nvfp4_spec("grad_output", False), dy_col)
        return OperandSpecs(input=x, weight=w, grad_output=dy)

    def __setstate__(self, state: dict) -> None:
        # A recipe pickled before the rename (torch.save of a model) carries the old names.
        self.__dict__.update(_renamed(state, stacklevel=2))

    # ---- the environment ---------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides) -> "NVFP4TrainingRecipe":
        """Build a recipe from QTENSOR_* variables (parsed by qtensor/backends/env.py, from
        `environ` or the process environment as first read); keyword args win."""
        fields: dict = {}
        for var, value in env.read(ENV_VARS, environ).items():
            name, negate = ENV_VARS[var]
            fields[name] = not value if negate else value
        fields.update(_renamed(overrides, stacklevel=2))
        return cls(**fields)


def _in_scope(scope: str, role: str) -> bool:
    return scope == "all" or (scope == "weights" and role == "weight") or (
        scope == "activations" and role == "input"
    )


def _check_choice(name, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}.")


# QTENSOR_* variable -> (recipe field, negated). Each mirrors the NVTE_* variable of the same
# suffix in Transformer Engine (docs/training.md lists both), so one setting maps to the other;
# qtensor/backends/env.py declares each one's type and allowed values. The DISABLE_* flags set
# the negation of their field.
ENV_VARS = {
    "QTENSOR_NVFP4_DISABLE_2D_QUANTIZATION": ("weight_2d", True),
    "QTENSOR_NVFP4_DISABLE_RHT": ("rht", True),
    "QTENSOR_NVFP4_DISABLE_STOCHASTIC_ROUNDING": ("stochastic_rounding", True),
    "QTENSOR_NVFP4_ROW_SCALED_ACTIVATION": ("row_scaled_activation", False),
    "QTENSOR_NVFP4_4OVER6": ("fourover6_roles", False),
    "QTENSOR_NVFP4_4OVER6_ERR_MODE": ("fourover6_error", False),
    "QTENSOR_NVFP4_4OVER6_E4M3_USE_256": ("fourover6_e4m3_256_roles", False),
    "QTENSOR_NVFP4_4OVER6_GRAD": ("fourover6_grad", False),
    "QTENSOR_NVFP4_DGRAD_MXFP8": ("dgrad_mxfp8", False),
    "QTENSOR_BACKWARD_OVERRIDE": ("backward_override", False),
    "QTENSOR_NVFP4_SEED": ("seed", False),
}
