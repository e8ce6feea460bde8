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
