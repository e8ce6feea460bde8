"""The quantized tensor classes and their op tables."""

from qtensor.tensors import gather as _gather  # noqa: F401  (FSDP2's all-gather hooks)
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.decode import DecodeWeight, share_decode_storage, to_decode_layout
from qtensor.tensors.fp8_block import FP8BlockTensor
from qtensor.tensors.hybrid import HybridSpec, HybridTensor, quantize_spec
from qtensor.tensors.mxfp4 import MXFP4Tensor
from qtensor.tensors.mxfp8 import MXFP8Tensor
from qtensor.tensors.nvfp4 import NVFP4Tensor

__all__ = ["DecodeWeight", "FP8BlockTensor", "HybridSpec", "HybridTensor", "MXFP4Tensor", "MXFP8Tensor", "NVFP4Tensor",
           "QuantizedTensor", "quantize_spec", "share_decode_storage", "to_decode_layout"]
