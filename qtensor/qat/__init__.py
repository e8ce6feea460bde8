"""MXFP4 weight QAT on MXFP8 and FP8 128x128 block-scaled training recipes (docs/qat.md).

`MXFP4QATConfig` and `quantize_` load torchao and so are imported lazily; the rest is plain
torch. Module map: convert.py (projection and direct conversions, the reference), hosts.py (host
operands and GEMMs), cache.py (weight cache, CUDA-graph skip gate), linear.py (autograd linear
and module), kernels.py (fused ops), export.py (MXFP4 deployment tensors), config.py.
"""

from qtensor.qat.export import decode_weight, export_state_dict, export_weight
from qtensor.qat.hosts import Host
from qtensor.qat.linear import MXFP4QATLinear

_LAZY = {"MXFP4QATConfig", "quantize_"}


def __getattr__(name):
    if name in _LAZY:
        from qtensor.qat import config

        return getattr(config, name)
    raise AttributeError(f"module 'qtensor.qat' has no attribute {name!r}")


__all__ = ["Host", "MXFP4QATConfig", "MXFP4QATLinear", "decode_weight", "export_state_dict",
           "export_weight", "quantize_"]
