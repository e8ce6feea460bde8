"""Scale layouts: compact [rows, cols] block scales <-> the swizzled layout of block-scaled GEMMs.

The pure-torch reference of docs/formats.md, "Scale layouts": rows padded to 128 and columns to 4
with zeros, then 512-byte tiles in row-major order over (row / 128, col / 4), the byte of (row, col)
at offset `(row % 32) * 16 + ((row % 128) / 32) * 4 + col % 4` inside its tile. The swizzled
tensor keeps the padded 2-D shape [ceil128(rows), ceil4(cols)] with its bytes in that order, so a
GEMM can hand `.view(-1)` to a kernel. Works for any 1-byte scale dtype (E4M3, UE8M0).
"""

from __future__ import annotations

import torch


def padded_shape(rows: int, cols: int) -> tuple[int, int]:
    """[ceil(rows / 128) * 128, ceil(cols / 4) * 4]: the swizzled tensor's shape."""
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def _check(scale: torch.Tensor) -> None:
    if scale.dim() != 2 or scale.element_size() != 1:
        raise ValueError(
            "scale layouts take a 2-D tensor of 1-byte scales [rows, cols]; got "
            f"{scale.dtype} {tuple(scale.shape)}. Flatten leading dims first."
        )


def swizzle(scale: torch.Tensor) -> torch.Tensor:
    """Compact [rows, cols] -> swizzled [ceil128(rows), ceil4(cols)], zero padding."""
    _check(scale)
    rows, cols = scale.shape
    pr, pc = padded_shape(rows, cols)
    padded = torch.zeros(pr, pc, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = scale.view(torch.uint8)
    # [R/128, 4, 32, C/4, 4] -> [R/128, C/4, 32, 4, 4]: tile, row % 32, (row % 128) / 32, col % 4.
    tiles = padded.reshape(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(pr, pc).view(scale.dtype)


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled [ceil128(rows), ceil4(cols)] -> compact [rows, cols]."""
    _check(swizzled)
    pr, pc = padded_shape(rows, cols)
    if tuple(swizzled.shape) != (pr, pc):
        raise ValueError(
            f"a swizzled scale of {rows}x{cols} is {pr}x{pc} (rows padded to 128, columns to 4); "
            f"got {tuple(swizzled.shape)}."
        )
    tiles = swizzled.view(torch.uint8).reshape(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(pr, pc)[:rows, :cols].contiguous().view(swizzled.dtype)
