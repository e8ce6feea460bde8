"""The torch.library ops over plain tensors that everything quantized runs on: quantization
(`quant`), the GEMMs (`gemm_ops`), each with its CPU kernel, CUDA kernel, fake and autograd.
They sit below the tensor classes; products of quantized tensors are the GEMM layer's
(qtensor/gemm).
"""
