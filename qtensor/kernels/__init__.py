"""Triton GEMM kernels for quantized operands, one file per family.

Nothing here is imported by `import qtensor`: the GEMM layer (qtensor/gemm/dense.py) imports a
kernel module the first time a product runs on the `triton` backend, so Triton is loaded only
where it is used.

- `tiles.py`: the shared device functions (decode packed codes and scales to exact bf16 tiles,
  the K loop on bf16 tensor cores with fp32 accumulation, the fused epilogue).
- `qgemm.py`: dense and batched products, with split-K for small M (the weight-only decode
  path that streams the weight).
- `grouped_qgemm.py`: `torch._grouped_mm`-style products for MoE experts.
"""
