"""The GEMM layer: products of quantized tensors, above the tensor classes.

`dense` holds the one dispatch point of a product (`quantized_mm`, F.linear, the aten mm
family on quantized tensors) and its planner; `grouped` the MoE `torch._grouped_mm` on top of
it; `scaled_mm` the native block-scaled call. Every product runs through the GEMM ops of
qtensor/ops (torch.library, below the tensors). Importing this package registers the handlers.
"""

from qtensor.gemm import dense, grouped  # noqa: F401  (register the handlers)
from qtensor.gemm.dense import gemm_plan, quantized_mm, with_gemm_backend

__all__ = ["gemm_plan", "quantized_mm", "with_gemm_backend"]
