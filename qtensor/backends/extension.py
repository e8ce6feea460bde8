"""The compiled extension qtensor._C: loading it, why it failed, and which kernels it holds.

`import qtensor._C` registers the torch.ops.qtensor.* schemas and their CPU (and, where built,
CUDA) kernels (csrc/). A failed import is not an error: every op then runs the reference, and
`EXTENSION_ERROR` says why.
"""

from __future__ import annotations

import torch


def _load_extension() -> str | None:
    """Import qtensor._C, which registers torch.ops.qtensor.*; why it failed, or None."""
    try:
        import qtensor._C  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


# Why the compiled kernels are unavailable (None when they loaded); shown by `extension_status`.
EXTENSION_ERROR = _load_extension()


def has_ops(*names: str) -> bool:
    """Whether the loaded extension defines every op `names` (an extension built from an older
    tree may lack newer ones)."""
    return EXTENSION_ERROR is None and all(hasattr(torch.ops.qtensor, n) for n in names)


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether the loaded extension has a kernel for qtensor::`op` on `dispatch_key` ("CPU",
    "CUDA"): the CUDA kernels exist only where the extension was built with nvcc."""
    return has_ops(op) and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"qtensor::{op}", dispatch_key
    )


def extension_status() -> str:
    """One line: which kernels are built, or why none are."""
    if EXTENSION_ERROR is not None:
        return f"qtensor._C not loaded ({EXTENSION_ERROR}); every op runs the reference"
    cuda = has_kernel("nvfp4_quantize", "CUDA")
    return "qtensor._C loaded: CPU kernels" + (" and CUDA kernels" if cuda else " (no CUDA)")
