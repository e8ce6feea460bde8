"""Launch a Triton kernel with less host work than Triton's own launch path.

[Note: direct launch]
`kernel[grid](*args)` (JITFunction.run) binds every argument, formats its specialization as a
string key and looks the compiled kernel up on every call: with the ~40 arguments of a GEMM
kernel that is tens of microseconds of Python per launch, as long as the decode GEMM itself.
`Launcher` keeps a cache of its own with a cheaper key, stricter than what Triton
specializes on: a tensor's dtype and the low 4 bits of its data pointer (Triton specializes on
16-byte alignment), every other argument by value (Triton specializes ints on being 1, on
divisibility by 16 and on their range), the constexprs and the launch options. Two calls with
one key therefore always get the kernel Triton would pick. A host TMA descriptor (Triton's
`TensorDescriptor`, which the persistent kernels take) is keyed by its base's dtype and
alignment, its shape, strides, block shape and padding: again at least what Triton specializes
on, and the compiled kernel's launcher encodes the CUDA tensor map from it on every launch, as
Triton's own path does. The first launch of a key goes through `kernel[grid]`, which compiles
(or finds) that kernel and returns it; later launches with the same key call the compiled
kernel's launcher directly. Whenever a launch hook is installed (profilers use them) every
launch takes Triton's own path, and a Triton whose compiled kernels lack the launcher
attributes used here falls back to it for good.

`Launcher.bind(grid, **constexprs)` goes one step further for a caller that launches one
kernel many times with arguments that change only in tensors of the same dtype and 16-byte
alignment (a prepared product: new activation, new output, the same weight): the `Bound`
launch keeps the compiled kernel of its first launch and skips the key altogether.
"""

from __future__ import annotations

import functools

import torch


class Launcher:
    """`Launcher(fn)(grid, *args, **constexprs_and_options)` launches `fn[grid](...)`.

    Positional arguments are the kernel's runtime arguments in signature order; keyword
    arguments are its constexprs and the launch options (num_warps, num_stages, ...). The
    constexprs must be named after the runtime arguments in the signature, as Triton's
    launcher receives every parameter in signature order. A runtime parameter whose name ends in
    `_desc` takes a host `TensorDescriptor` (or None).
    """

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        # Positions of the runtime arguments passed as host TMA descriptors (or None).
        self.desc_index = tuple(i for i, p in enumerate(p for p in params if not p.is_constexpr)
                                if p.name.endswith("_desc"))
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
        # Stricter than Triton's specialization (ints and floats by value), so a key never
        # maps to a kernel Triton would not pick, and cheap to build: one pass, no calls.
        vals = [(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a for a in args]
        for i in self.desc_index:
            vals[i] = _desc_key(args[i])
        key = (device, tuple(vals), tuple(kwargs.items()))
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


    def bind(self, grid, **kwargs) -> "Bound":
        return Bound(self, tuple(grid), kwargs)


class Bound:
    """One kernel at one grid with fixed constexprs. The caller guarantees that every call's
    runtime arguments agree with the first call's in dtype and 16-byte alignment of each tensor
    and in the value of every other argument, so the first call's compiled kernel is the one
    Triton would pick for each."""

    __slots__ = ("launcher", "grid", "kwargs", "constexprs", "kernel")

    def __init__(self, launcher: Launcher, grid: tuple, kwargs: dict):
        self.launcher, self.grid, self.kwargs = launcher, grid + (1,) * (3 - len(grid)), kwargs
        self.constexprs = [kwargs[n] for n in launcher.constexpr_names]
        self.kernel = None

    def __call__(self, stream: int, *args) -> None:
        kernel = self.kernel
        if kernel is None or not self.launcher.direct or _hooks_installed():
            self.kernel = self.launcher(self.grid, *args, **self.kwargs)
            return
        g = self.grid
        try:
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None,
                       None, None, *args, *self.constexprs)
        except (TypeError, SystemError):
            self.launcher.direct = False
            self.launcher.fn[g](*args, **self.kwargs)


def _desc_key(d):
    """A host TMA descriptor's key (None stays None): the base's dtype and 16-byte alignment,
    shape, strides, block shape and padding."""
    if d is None:
        return None
    return (d.base.dtype, d.base.data_ptr() & 15, tuple(d.shape), tuple(d.strides),
            tuple(d.block_shape), getattr(d, "padding", "zero"))


def _hooks_installed() -> bool:
    """Whether a launch hook is set: Tritons with `knobs` keep chains of hooks there (empty when
    none is installed), older ones a hook or None on CompiledKernel."""
    holder, enter, exit_ = _hook_slots()
    return any(h is not None and bool(getattr(h, "calls", True))
               for h in (getattr(holder, enter), getattr(holder, exit_)))


@functools.cache
def _hook_slots() -> tuple:
    """(object, enter attribute, exit attribute) where this Triton keeps its launch hooks: found
    once, read on every launch (a profiler may install a hook at any time)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        from triton.compiler import CompiledKernel

        return CompiledKernel, "launch_enter_hook", "launch_exit_hook"
    return knobs.runtime, "launch_enter_hook", "launch_exit_hook"
