"""MXFP4 weight QAT on MXFP8 and FP8 128x128 block-scaled training recipes (docs/qat.md).

QAT is a weight transform feeding the training stack (qtensor/training): the hosts are operand
specs of the training roles and the weight's operand is its MXFP4 projection in host bytes;
MXFP4QATLinear runs the training autograd linear and weight cache. `MXFP4QATConfig` and
`quantize_` load torchao and so are imported lazily; the rest is plain torch. Module map:
convert.py (projection and direct conversions, the reference), kernels.py (fused ops), hosts.py
(the hosts as OperandSpecs, the weight transform, the GEMM backend), linear.py (the module),
export.py (MXFP4 deployment tensors), config.py.
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
