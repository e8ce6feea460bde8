"""qtensor: NVFP4, MXFP8, MXFP4, FP8 block and hybrid quantized tensors for PyTorch.

`import qtensor` neither initialises CUDA nor imports Triton or transformers.
"""

import torch as _torch

from qtensor.checkpoint import from_pretrained, load_file, save_file, save_pretrained
from qtensor.checkpoint import hf_hook as _hf_hook
from qtensor.formats import MXFP4Spec, MXFP8Spec, NVFP4Spec
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor import gemm as _gemm  # noqa: F401  registers the GEMM handlers and F.linear
from qtensor.gemm import quantized_mm
from qtensor.tensors import (DecodeWeight, FP8BlockTensor, HybridTensor, MXFP4Tensor, MXFP8Tensor,
                             NVFP4Tensor, QuantizedTensor, share_decode_storage,
                             to_decode_layout)

from qtensor.version import __version__  # noqa: E402

# Quantized tensors and their specs load with torch.load(weights_only=True).
_torch.serialization.add_safe_globals(
    [NVFP4Tensor, MXFP8Tensor, HybridTensor, FP8BlockTensor, MXFP4Tensor, NVFP4Spec, MXFP8Spec,
     FP8BlockSpec, MXFP4Spec]
)

_LAZY = {  # these import torchao, transformers or Inductor, so they load on first use
    "FuseDecodeProducts": "qtensor.ops.decode_fusion",
    "MXFP4WeightOnlyConfig": "qtensor.quantize",
    "MXFP8DynamicActivationMXFP8WeightConfig": "qtensor.quantize",
    "MXFP8WeightOnlyConfig": "qtensor.quantize",
    "NVFP4DynamicActivationNVFP4WeightConfig": "qtensor.quantize",
    "NVFP4WeightOnlyConfig": "qtensor.quantize",
    "quantize_": "qtensor.quantize",
    "QTensorConfig": "qtensor.checkpoint.hf",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qtensor' has no attribute {name!r}")


__all__ = [
    "DecodeWeight",
    "FP8BlockSpec",
    "FP8BlockTensor",
    "FuseDecodeProducts",
    "HybridTensor",
    "MXFP4Spec",
    "MXFP4Tensor",
    "MXFP4WeightOnlyConfig",
    "MXFP8DynamicActivationMXFP8WeightConfig",
    "MXFP8Spec",
    "MXFP8Tensor",
    "MXFP8WeightOnlyConfig",
    "NVFP4DynamicActivationNVFP4WeightConfig",
    "NVFP4Spec",
    "NVFP4Tensor",
    "NVFP4WeightOnlyConfig",
    "QTensorConfig",
    "QuantizedTensor",
    "from_pretrained",
    "load_file",
    "quantize_",
    "quantized_mm",
    "save_file",
    "save_pretrained",
    "share_decode_storage",
    "to_decode_layout",
]

# transformers learns quant_method "qtensor" when (and only if) it is imported, before or after
# qtensor: qtensor/checkpoint/hf_hook.py.
_hf_hook.install()
