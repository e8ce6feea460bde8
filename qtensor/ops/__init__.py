"""Operations on quantized tensors: quantization and the GEMMs.

- `quant`: the quantization ops (the csrc/ kernels as torch.ops.qtensor.*, with their fakes)
  and the one dispatch point the tensor subclasses call; it runs the pure-torch reference of
  qtensor/formats where no kernel is built.
- `gemm`: products of quantized tensors (F.linear, mm, matmul, ...), the exact emulated
  reference every faster backend must match, and the choice of backend per product.
- `grouped_gemm`: `torch._grouped_mm` on quantized operands (MoE experts).
- `gemm_ops`: the GEMM torch.library ops (qtensor::nvfp4_mm and family): their CPU and CUDA
  kernels (the reference, the Triton kernels of qtensor/kernels), fakes and autograd.
- `gemm_operands`: the operands as those ops take them, their argument checks and the epilogue.
- `scaled_mm`: the native block-scaled torch._scaled_mm backend (sm_100+).
"""
