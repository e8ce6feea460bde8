"""Type checks for the fields of the frozen spec and config dataclasses, run at construction.

A spec is stored in checkpoints and compared field by field, so a field holds exactly its
declared type: `block_2d=1` would be written and then refused on load, and `e4m3_bound=256.0`
would pass a value check and reach a C++ kernel as a float. Fields annotated `bool` must be
bools and fields annotated `int` must be ints (a bool is not an int here).
"""

from __future__ import annotations

import dataclasses


def check_field_types(obj) -> None:
    """Raise TypeError naming the first `bool` or `int` field of dataclass `obj` whose value
    has another type."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "bool" and type(value) is not bool:
            raise TypeError(
                f"{type(obj).__name__}.{f.name} must be a bool (True or False); got {value!r} "
                f"({type(value).__name__})."
            )
        if f.type == "int" and type(value) is not int:
            raise TypeError(
                f"{type(obj).__name__}.{f.name} must be an int; got {value!r} "
                f"({type(value).__name__}). Pass {f.name}=int(...)."
            )


def either(values) -> str:
    """The allowed values as an error message lists them: "448 or 256", "None, 'mae' or 'mse'"."""
    names = [repr(v) for v in values]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
