"""The torch.library ops over plain tensors that everything quantized runs on; they sit below
the tensor classes (products of quantized tensors are the GEMM layer's, qtensor/gemm).

- `quant`: the quantization ops (the csrc/ kernels as torch.ops.qtensor.*, with their fakes)
  and the one dispatch point the tensor classes call; it runs the pure-torch reference of
  qtensor/formats where no kernel is built.
- `fp8_block`: qtensor::fp8_block_quantize, FP8 1x128 blocks (its CUDA kernel is Triton).
- `gemm_ops`: the GEMM torch.library ops (qtensor::nvfp4_mm and family): their CPU and CUDA
  kernels (the reference, the Triton kernels of qtensor/kernels), fakes and autograd.
- `gemm_operands`: the operands as those ops take them, their argument checks and the epilogue.
- `decode_mm`: qtensor::decode_mm, a weight in the decode layout times an activation;
  `decode_fusion`: the Inductor pass that makes the quantized products (decode_mm and the
  dense ops of canonical weights) of one activation one call.
"""
