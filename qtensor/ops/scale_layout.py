"""Scale layouts: compact [rows, cols] block scales <-> the swizzled layout of block-scaled GEMMs.

[Note: swizzled scales] (FORMATS.md, "Scale layouts")
The block-scaled tensor cores of sm_100+ read scales in 512-byte tiles covering 128 rows x 4
scale columns. Rows are padded to a multiple of 128 and columns to a multiple of 4 with zeros;
tiles are laid out row-major over (row // 128, col // 4); inside a tile the scale of (row, col)
sits at byte `(row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4`. This is the one definition
of that layout in the project: the GEMM layer and any kernel that emits swizzled scales use it.
"""

from __future__ import annotations

import torch

TILE_ROWS, TILE_COLS = 128, 4


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """(padded rows, padded cols) of the swizzled layout."""
    return -(-rows // TILE_ROWS) * TILE_ROWS, -(-cols // TILE_COLS) * TILE_COLS


def to_swizzled(scale: torch.Tensor) -> torch.Tensor:
    """Compact scales [rows, cols] -> the flat swizzled buffer (same dtype, zero padding)."""
    if scale.dim() != 2:
        raise ValueError(
            f"to_swizzled takes compact 2-D scales [rows, cols]; got shape {tuple(scale.shape)}."
        )
    rows, cols = scale.shape
    prow, pcol = swizzled_shape(rows, cols)
    raw = scale.view(torch.uint8)  # pad and permute bytes: fp8 dtypes lack some copy kernels
    padded = raw.new_zeros((prow, pcol))
    padded[:rows, :cols] = raw
    # [row tile, 4 sub-blocks of 32 rows, 32 rows, col tile, 4 cols] -> tile-major, then
    # (row % 32, sub-block, col % 4) inside a tile: the offset formula above.
    t = padded.view(prow // TILE_ROWS, 4, 32, pcol // TILE_COLS, TILE_COLS)
    return t.permute(0, 3, 2, 1, 4).reshape(-1).view(scale.dtype)


def from_swizzled(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of to_swizzled: compact [rows, cols] scales from the flat swizzled buffer."""
    prow, pcol = swizzled_shape(rows, cols)
    if flat.numel() != prow * pcol:
        raise ValueError(
            f"a swizzled buffer for [{rows}, {cols}] scales holds {prow * pcol} bytes; got "
            f"{flat.numel()}."
        )
    t = flat.view(torch.uint8).view(prow // TILE_ROWS, pcol // TILE_COLS, 32, 4, TILE_COLS)
    compact = t.permute(0, 3, 2, 1, 4).reshape(prow, pcol)
    return compact[:rows, :cols].contiguous().view(flat.dtype)
