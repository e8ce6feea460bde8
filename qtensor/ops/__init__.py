"""Operations on quantized tensors: the GEMM layer (emulated reference backend for now)."""
