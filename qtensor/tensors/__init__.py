"""The quantized tensor classes and their op tables."""

from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.hybrid import HybridTensor, quantize_spec
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor
from qtensor.distributed import ops as _distributed_ops  # noqa: F401,E402  (new_zeros, as_strided)

__all__ = ["HybridTensor", "MXFP8Tensor", "NVFP4Tensor", "QuantizedTensor", "quantize_spec"]
