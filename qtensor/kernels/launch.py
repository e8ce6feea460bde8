"""Launch a Triton kernel with the host work of one dictionary lookup.

[Note: direct launch]
`kernel[grid](*args)` (JITFunction.run) binds every argument, formats its specialization as a
string key and looks the compiled kernel up on every call: with the ~40 arguments of a GEMM
kernel that is tens of microseconds of Python per launch, as long as the decode GEMM itself.
`Launcher` keeps the same cache semantics with a cheaper key. The key is what Triton
specializes on, computed directly from the arguments:
- a tensor: its dtype and whether its data pointer is 16-byte aligned;
- an int: whether it is 1, whether it is divisible by 16, and whether it fits in int32;
- a float or a bool: its type; a constexpr: its value; the launch options.
The first launch of a key goes through `kernel[grid]`, which compiles (or finds) the kernel
Triton would pick for these arguments and returns it; later launches with the same key call
that compiled kernel's launcher directly. Whenever a launch hook is installed (profilers use
them) every launch takes Triton's own path, and a Triton whose compiled kernels lack the
launcher attributes used here falls back to it for good.
"""

from __future__ import annotations

import torch

_INT32 = 2**31


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_INT32 <= a < _INT32)
    if isinstance(a, float):
        return float
    return a  # constexpr-like values (ints passed as constexpr are handled by the caller)


class Launcher:
    """`Launcher(fn)(grid, *args, **constexprs_and_options)` launches `fn[grid](...)`.

    Positional arguments are the kernel's runtime arguments in signature order; keyword
    arguments are its constexprs and the launch options (num_warps, num_stages, ...). The
    constexprs must be named after the runtime arguments in the signature, as Triton's
    launcher receives every parameter in signature order.
    """

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self.n_runtime = sum(not p.is_constexpr for p in params)
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        if [p.is_constexpr for p in params] != [False] * self.n_runtime + [True] * len(
                self.constexpr_names):
            raise TypeError(f"{fn}: the direct launcher needs the constexprs last.")
        self.cache: dict = {}
        self.direct = True

    def __call__(self, grid, *args, **kwargs):
        if len(args) != self.n_runtime:
            raise TypeError(f"{self.fn}: {self.n_runtime} runtime arguments, got {len(args)}.")
        if not self.direct or _hooks_installed():
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, tuple(map(_arg_key, args)), tuple(sorted(kwargs.items())))
        kernel = self.cache.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if not all(hasattr(kernel, n) for n in ("run", "function", "packed_metadata")):
                self.direct = False
            self.cache[key] = kernel
            return kernel
        constexprs = [kwargs[n] for n in self.constexpr_names]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        try:
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                       None, None, *args, *constexprs)
        except (TypeError, SystemError):  # a launcher of another signature: Triton's path
            self.direct = False
            return self.fn[grid](*args, **kwargs)
        return kernel


def _hooks_installed() -> bool:
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # Tritons before knobs keep the hooks on CompiledKernel
        from triton.compiler import CompiledKernel

        return (getattr(CompiledKernel, "launch_enter_hook", None) is not None
                or getattr(CompiledKernel, "launch_exit_hook", None) is not None)
    hooks = knobs.runtime
    return hooks.launch_enter_hook is not None or hooks.launch_exit_hook is not None
