"""The environment: every QTENSOR_* variable, one parser per type, read once.

[Note: the environment] This is the only module of qtensor that reads the process environment
(tests/test_backends_env.py walks the package's source and fails on any other reader). Every
variable is declared once in `VARIABLES` (name, type, allowed values, what it does, who reads
it); docs/environment.md lists the same table and a test keeps the two equal. The process
environment is read at first use and kept (`read()`), so a value never changes under a running
program or a compiled graph; `reset()` makes the next use read it again (tests). Callers that
build a config from a mapping they were given (`NVFP4TrainingRecipe.from_env(environ)`,
`MXFP4QATConfig.from_env(environ)`) parse it with the same table (`read(names, environ)`).

Rules shared by every variable: surrounding whitespace is ignored, an empty value counts as
unset, and choices and booleans are case-insensitive. An invalid value raises, naming the
variable, the value and the allowed values.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Iterable, Mapping


class Kind(str, enum.Enum):
    BOOL = "bool"  # one of TRUE or FALSE
    INT = "int"  # a Python int literal, as int() reads it
    CHOICE = "choice"  # one of Variable.choices
    TEXT = "text"  # any string, kept as given (build-time settings)


# The one boolean vocabulary. The training recipe took 0/1 and the QAT config took
# 1/true/yes/on and 0/false/no/off; this is the union, so every value that worked still does.
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    kind: Kind
    effect: str  # what setting it does, one sentence for docs/environment.md
    read_by: str  # the code that reads it
    choices: tuple[str, ...] = ()  # Kind.CHOICE: the allowed values, lower case
    none_as_none: bool = False  # Kind.CHOICE: the value "none" parses to None
    build_time: bool = False  # read by setup.py when the extension is built, not at run time

    def __post_init__(self):
        if (self.kind is Kind.CHOICE) != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with Kind.CHOICE and only with it.")
        if self.none_as_none and "none" not in self.choices:
            raise ValueError(f"{self.name}: none_as_none needs 'none' among the choices.")

    def allowed(self) -> str:
        """The allowed values, as error messages and docs/environment.md say them."""
        if self.kind is Kind.BOOL:
            return f"{', '.join(TRUE)} (true) or {', '.join(FALSE)} (false), any case"
        if self.kind is Kind.CHOICE:
            return ", ".join(self.choices) + " (any case)"
        return "an integer" if self.kind is Kind.INT else "any text"


_SCOPES = ("none", "weights", "activations", "all")  # qtensor.training.recipe.SCOPES
_OVERRIDES = ("none", "high_precision", "dequantized")  # recipe.OVERRIDES, None as "none"
_RECIPE = "NVFP4TrainingRecipe.from_env (qtensor/training/recipe.py)"
_QAT = "MXFP4QATConfig.from_env (qtensor/qat/config.py)"
_POLICY = "BackendPolicy.from_env (qtensor/backends/policy.py), once per process"


VARIABLES: tuple[Variable, ...] = (
    Variable("QTENSOR_QUANT_BACKEND", Kind.CHOICE,
             "reference: quantize with the pure-torch reference even where the C++/CUDA "
             "kernels exist; auto (the default): the kernels where they are built",
             _POLICY, choices=("auto", "reference")),
    Variable("QTENSOR_GEMM_BACKEND", Kind.CHOICE,
             "the GEMM backend of every tensor made from then on; unset: the fastest one the "
             "device runs (an override the device cannot run raises)",
             _POLICY, choices=("emulated", "triton", "scaled_mm")),
    Variable("QTENSOR_NVFP4_DISABLE_2D_QUANTIZATION", Kind.BOOL,
             "true sets weight_2d=False (1x16 weight blocks)", _RECIPE),
    Variable("QTENSOR_NVFP4_DISABLE_RHT", Kind.BOOL, "true sets rht=False", _RECIPE),
    Variable("QTENSOR_NVFP4_DISABLE_STOCHASTIC_ROUNDING", Kind.BOOL,
             "true sets stochastic_rounding=False", _RECIPE),
    Variable("QTENSOR_NVFP4_ROW_SCALED_ACTIVATION", Kind.BOOL, "sets row_scaled_activation",
             _RECIPE),
    Variable("QTENSOR_NVFP4_4OVER6", Kind.CHOICE, "sets fourover6_roles", _RECIPE, choices=_SCOPES),
    Variable("QTENSOR_NVFP4_4OVER6_ERR_MODE", Kind.CHOICE, "sets fourover6_error", _RECIPE,
             choices=("mae", "mse")),
    Variable("QTENSOR_NVFP4_4OVER6_E4M3_USE_256", Kind.CHOICE, "sets fourover6_e4m3_256_roles",
             _RECIPE, choices=_SCOPES),
    Variable("QTENSOR_NVFP4_4OVER6_GRAD", Kind.BOOL, "sets fourover6_grad", _RECIPE),
    Variable("QTENSOR_NVFP4_DGRAD_MXFP8", Kind.BOOL, "sets dgrad_mxfp8", _RECIPE),
    Variable("QTENSOR_BACKWARD_OVERRIDE", Kind.CHOICE,
             "sets backward_override (none: the quantized backward)", _RECIPE,
             choices=_OVERRIDES, none_as_none=True),
    Variable("QTENSOR_NVFP4_SEED", Kind.INT, "sets seed (an integer >= 0)", _RECIPE),
    Variable("QTENSOR_MXFP4_QAT_HOST", Kind.CHOICE, "sets host", _QAT,
             choices=("mxfp8", "fp8_block128")),
    Variable("QTENSOR_MXFP4_QAT_DIRECT", Kind.BOOL, "sets direct", _QAT),
    Variable("QTENSOR_MXFP4_QAT_BACKWARD_OVERRIDE", Kind.CHOICE,
             "sets backward_override (none: the quantized backward)", _QAT,
             choices=_OVERRIDES, none_as_none=True),
    Variable("QTENSOR_NO_EXTENSION", Kind.TEXT,
             "1 builds no C++/CUDA extension (every op then runs the reference)",
             "setup.py, when the extension is built", build_time=True),
    Variable("QTENSOR_CUDA_ARCHS", Kind.TEXT,
             "the CUDA targets to build, ';'-separated (e.g. 90a;100a)",
             "setup.py, when the extension is built", build_time=True),
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


# ---- one parser per type -----------------------------------------------------------------------


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"{name} must be a boolean: {BY_NAME[name].allowed()}; got {raw!r}.")


def parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {raw!r}.") from None


def parse_choice(name: str, raw: str) -> str | None:
    var = BY_NAME[name]
    value = raw.strip().lower()
    if value not in var.choices:
        raise ValueError(
            f"{name} must be one of {var.allowed()}; got {raw!r}. Unset it for the default."
        )
    return None if var.none_as_none and value == "none" else value


def parse_text(name: str, raw: str) -> str:
    return raw.strip()


PARSERS = {Kind.BOOL: parse_bool, Kind.INT: parse_int, Kind.CHOICE: parse_choice,
           Kind.TEXT: parse_text}


def parse(name: str, raw: str):
    """The value of variable `name` set to `raw` (a non-empty string)."""
    return PARSERS[BY_NAME[name].kind](name, raw)


# ---- reading ---------------------------------------------------------------------------------


_process: dict[str, str] | None = None  # the table's variables as first read, raw


def _process_environment() -> dict[str, str]:
    global _process
    if _process is None:
        _process = {v.name: os.environ[v.name] for v in VARIABLES
                    if not v.build_time and v.name in os.environ}
    return _process


def read(names: Iterable[str], environ: Mapping[str, str] | None = None) -> dict:
    """{name: parsed value} of the variables among `names` that are set (an empty value counts
    as unset), from `environ`, or from the process environment as read at its first use."""
    source = _process_environment() if environ is None else environ
    values = {}
    for name in names:
        if name not in BY_NAME:
            raise KeyError(f"{name} is not declared in qtensor/backends/env.py VARIABLES")
        raw = source.get(name)
        if raw is not None and raw.strip():
            values[name] = parse(name, raw)
    return values


def reset() -> None:
    """Forget the process environment read so far: the next `read()` reads it again."""
    global _process
    _process = None


def child_environment() -> dict[str, str]:
    """A copy of the whole process environment as it is now, for a child process (`qtensor
    bench` runs each benchmark script in one, which inherits every variable)."""
    return dict(os.environ)
