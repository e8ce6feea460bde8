"""Registering qtensor with transformers without importing transformers.

`install()` (run by `import qtensor`) arranges for qtensor/checkpoint/hf.py, which registers
qtensor's quantization config and quantizer with transformers, to be imported right after
`transformers.quantizers.auto` (transformers' quantizer registry) is executed:
- if that module is already imported (transformers came first), hf.py is imported at once;
- otherwise a finder is put at the front of `sys.meta_path`. It answers only for that module
  name: it asks the finders behind it for the module's spec and wraps the spec's loader, so that
  the module executes as usual and hf.py is imported after it. The finder removes itself on its
  first use (and puts itself back if the module then fails to execute, for a later import).
So `import qtensor` costs a list insertion, a program that never imports transformers never
imports hf.py, and the import order does not matter. A registration that fails (a transformers
without the extension points hf.py uses) warns and leaves transformers working without qtensor;
`qtensor.from_pretrained` does not need it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

TARGET = "transformers.quantizers.auto"
INTEGRATION = "qtensor.checkpoint.hf"


def _register() -> None:
    try:
        importlib.import_module(INTEGRATION)
    except Exception as e:  # noqa: BLE001  transformers must keep working whatever the cause
        warnings.warn(
            f"qtensor could not register its quantizer with transformers ({type(e).__name__}: "
            f"{e}), so transformers' from_pretrained does not read qtensor checkpoints; "
            "qtensor.from_pretrained still does.", stacklevel=2)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the registration."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        except BaseException:
            install()
            raise
        _register()

    def __getattr__(self, name):  # get_source, get_code, ... as the wrapped loader has them
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now if transformers' registry is imported, else when it is; idempotent."""
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
