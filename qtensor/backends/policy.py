"""The process-wide backend policy: one frozen dataclass, built from the environment once.

[Note: backend policy] Two choices apply to the whole process rather than to one tensor or one
recipe: forcing the quantize reference (QTENSOR_QUANT_BACKEND=reference) and overriding the
GEMM backend of new tensors (QTENSOR_GEMM_BACKEND). `current_policy()` builds them from the
environment at first use and keeps them; `set_policy(...)` replaces them (tests, cross-checks)
and clears every cache that was filled from the old ones. A graph torch.compile traced earlier
keeps the choices it saw (qtensor/backends/choice.py reads them as compile-time constants).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from qtensor.backends import env
from qtensor.backends.kinds import GEMM_BACKENDS, GemmBackend

QUANT_BACKEND_ENV = "QTENSOR_QUANT_BACKEND"
GEMM_BACKEND_ENV = "QTENSOR_GEMM_BACKEND"


@dataclasses.dataclass(frozen=True)
class BackendPolicy:
    # Run the pure-torch quantize reference even where kernels exist (debugging, cross-checks).
    force_quant_reference: bool = False
    # The GEMM backend of every tensor made from now on; None: the fastest the device runs.
    gemm_override: GemmBackend | None = None

    def __post_init__(self):
        if not isinstance(self.force_quant_reference, bool):
            raise TypeError(
                f"force_quant_reference must be a bool; got {self.force_quant_reference!r}."
            )
        if self.gemm_override is not None and not isinstance(self.gemm_override, GemmBackend):
            raise TypeError(
                f"gemm_override must be a GemmBackend or None; got {self.gemm_override!r}. "
                f"Pass GemmBackend({self.gemm_override!r}) for one of "
                f"{', '.join(b.value for b in GemmBackend)}."
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "BackendPolicy":
        """The policy QTENSOR_QUANT_BACKEND and QTENSOR_GEMM_BACKEND set, from `environ` or the
        process environment as qtensor/backends/env.py read it."""
        values = env.read((QUANT_BACKEND_ENV, GEMM_BACKEND_ENV), environ)
        gemm = values.get(GEMM_BACKEND_ENV)
        return cls(
            force_quant_reference=values.get(QUANT_BACKEND_ENV) == "reference",
            gemm_override=GEMM_BACKENDS[gemm] if gemm is not None else None,
        )


_current: BackendPolicy | None = None
# cache_clear of every cache whose entries follow from the policy (choice.py registers them).
_dependent_caches: list[Callable[[], None]] = []


def current_policy() -> BackendPolicy:
    """The process-wide policy: built from the environment at first use, then kept."""
    global _current
    if _current is None:
        _current = BackendPolicy.from_env()
    return _current


def set_policy(policy: BackendPolicy | None) -> None:
    """Replace the process-wide policy; None reads the environment again at next use."""
    global _current
    if policy is not None and not isinstance(policy, BackendPolicy):
        raise TypeError(f"set_policy takes a BackendPolicy or None; got {type(policy).__name__}.")
    if policy is None:
        env.reset()
    _current = policy
    for clear in _dependent_caches:
        clear()


def depends_on_policy(cached):
    """Register a functools cache whose entries follow from the policy: set_policy clears it."""
    _dependent_caches.append(cached.cache_clear)
    return cached
