"""The random Hadamard transform applied to NVFP4 columnwise (wgrad) operands.

`M = diag(s) @ H16 / 4`, held in bf16 (every entry is +-0.25, exact). Each run of 16
consecutive elements along the reduction dim, as a row vector, is multiplied by M and the
result rounded once to bf16. The reference sums in fp64, which is the exact sum for any 16 bf16
inputs whose magnitudes span less than 2**45, then rounds to bf16; a GPU kernel that accumulates
in fp32 agrees whenever its fp32 sum is exact (spreads below 2**16).
"""

from __future__ import annotations

import functools

import torch

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@functools.cache
def _hadamard16() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@functools.cache
def rht_matrix() -> torch.Tensor:
    """The 16x16 transform M = diag(s) @ H / 4 in bf16."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64)
    return (signs[:, None] * _hadamard16() / 4).to(torch.bfloat16)


def apply_rht(x: torch.Tensor) -> torch.Tensor:
    """Transform each 16-run along the last dim of x; returns bf16 with x's shape."""
    if x.shape[-1] % 16:
        raise ValueError(f"RHT needs the last dim divisible by 16; got shape {tuple(x.shape)}.")
    runs = x.reshape(-1, 16).to(torch.float64)
    out = runs @ rht_matrix().to(device=x.device, dtype=torch.float64)
    return out.to(torch.bfloat16).reshape(x.shape)
