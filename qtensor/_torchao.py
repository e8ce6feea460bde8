"""torchao, imported once for its config base class and quantize_ registry, without its
import-time noise.

A torchao wheel carries optional compiled kernels (`_C*.so`) built for one CUDA; where they do
not load (a CPU-only torch, another CUDA) torchao logs "Failed to load <path>" once per file,
and torch logs a deprecation for the Enum torchao registers as a pytree constant. qtensor uses
none of those kernels, so while torchao imports, these two messages (and only these) are
dropped; every other torchao or torch message passes.
"""

from __future__ import annotations

import contextlib
import logging


class _Drop(logging.Filter):
    def __init__(self, starts: str, contains: str = ""):
        super().__init__()
        self.starts, self.contains = starts, contains

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith(self.starts) and self.contains in msg)


@contextlib.contextmanager
def _filtered(logger_name: str, flt: logging.Filter):
    logger = logging.getLogger(logger_name)
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


with _filtered("torchao", _Drop("Failed to load ", ".so")), \
        _filtered("torch.utils._pytree", _Drop("<enum ", "register_constant")):
    import torchao  # noqa: F401,E402
    import torchao.core.config  # noqa: F401,E402
    import torchao.quantization.transform_module  # noqa: F401,E402
