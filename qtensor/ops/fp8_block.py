"""The FP8 1x128 block quantization op, `qtensor::fp8_block_quantize(Tensor x, bool columnwise)
-> (Tensor data, Tensor scale)`: the bytes of qtensor/formats/fp8_block.py.

Its CUDA kernel is Triton (qtensor/kernels/fp8_block_quant.py, loaded on first use); on every
other device it runs the reference. An opaque op, so a compiled graph calls the same kernel as
eager code. FP8BlockTensor.from_spec calls it where the project quantizes with its GPU kernels
(qtensor.backends.quant_backend), and the reference directly otherwise.
"""

from __future__ import annotations

import torch

from qtensor.formats import fp8_block as ref
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.ops.gemm_operands import apply_epilogue


@torch.library.custom_op("qtensor::fp8_block_quantize", mutates_args=())
def fp8_block_quantize(x: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data in x's shape, fp32 scales [..., K/128], or [M/128, K] columnwise)."""
    data, scale = ref.quantize(x, FP8BlockSpec("1x128", columnwise=columnwise))
    return data, scale


@fp8_block_quantize.register_kernel("cuda")
def _(x, columnwise):
    from qtensor.kernels import fp8_block_quant

    ref.check_shape(x.shape, FP8BlockSpec("1x128", columnwise=columnwise))
    return fp8_block_quant.quantize(x, columnwise)


@fp8_block_quantize.register_fake
def _(x, columnwise):
    ref.check_shape(x.shape, FP8BlockSpec("1x128", columnwise=columnwise))
    blocks = (x.shape[0] // ref.BLOCK, x.shape[1]) if columnwise else (
        *x.shape[:-1], x.shape[-1] // ref.BLOCK)
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(blocks, dtype=torch.float32))


# ---- the native GEMM ---------------------------------------------------------------------------

# cuBLAS reads 128x128 tile scales with a leading dimension of a whole number of 16-byte
# groups: a K-block count that is not a multiple of 4 gives wrong products (measured on sm_90,
# torch 2.11), and ATen's stride check admits no padding. Such products take the tiles as 1x128
# blocks instead, each row of a tile carrying the tile's scale: the same numbers.
TILE_K_BLOCKS = 4


def scaled_mm_scales(a_scale: torch.Tensor, b_scale: torch.Tensor, b_tiles: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_a, scale_b) of torch._scaled_mm for operands as rows along K: a [M, K] with 1x128
    scales [M, K/128]; b [N, K] with 128x128 tile scales [N/128, K/128] (b_tiles) or 1x128
    scales [N, K/128]. scale_a is [M, K/128] column-major; scale_b is the tile scales'
    [K/128, N/128] transpose view (strides (1, K/128)) or 1x128 scales [K/128, N] row-major."""
    scale_a = a_scale.t().contiguous().t()
    if b_tiles and b_scale.shape[1] % TILE_K_BLOCKS == 0:
        return scale_a, b_scale.contiguous().t()
    if b_tiles:
        b_scale = b_scale.repeat_interleave(ref.BLOCK, dim=0)
    return scale_a, b_scale.t().contiguous()


@torch.library.custom_op("qtensor::fp8_block_scaled_mm", mutates_args=())
def fp8_block_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                        b_scale: torch.Tensor, b_tiles: bool, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] x b [N, K]^T (rows along K, E4M3, fp32 block scales as qtensor::fp8_block_mm
    takes them) through torch._scaled_mm on the FP8 tensor cores (sm_90+), + bias in fp32, the
    cast. An opaque op, so a compiled graph makes the same cuBLAS call as eager code (Inductor
    would otherwise choose its own kernel for aten._scaled_mm)."""
    scale_a, scale_b = scaled_mm_scales(a_scale, b_scale, b_tiles)
    acc = torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                           out_dtype=torch.float32 if bias is not None else out_dtype)
    return acc if bias is None else apply_epilogue(acc, None, None, bias, out_dtype)


@fp8_block_scaled_mm.register_fake
def _(a, a_scale, b, b_scale, b_tiles, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
