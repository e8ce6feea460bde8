"""HybridTensor.from_hp takes the one-read gradient cast (MXFP8 rowwise + NVFP4 columnwise) when
its two specs are the dgrad-in-MXFP8 recipe's grad_output; the bytes must be those of the two
separate casts, whatever the backend (the C++ kernel here, the reference without it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qtensor import HybridTensor, MXFP8Spec, MXFP8Tensor, NVFP4Spec, NVFP4Tensor
from qtensor import backends

COLUMN_SPECS = [
    NVFP4Spec(),
    NVFP4Spec(rht=True, stochastic_rounding=True, columnwise=True),
    NVFP4Spec(fourover6="mae", e4m3_bound=256),
    NVFP4Spec(fourover6="mse"),
    NVFP4Spec(row_scaled=True),
]


def _bytes(t):
    return [getattr(t, n).view(torch.uint8) if getattr(t, n).dtype != torch.float32
            else getattr(t, n) for n in t.tensor_data_names]


@pytest.fixture(params=["kernels", "reference"])
def backend(request):
    """Run once with the compiled kernels (when built) and once with the reference forced."""
    if request.param == "reference":
        backends.set_policy(backends.BackendPolicy(force_quant_reference=True))
    yield request.param
    backends.set_policy(None)


@pytest.mark.parametrize("col", COLUMN_SPECS, ids=str)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_gradient_cast_equals_two_casts(col, rule, backend):
    g = torch.Generator().manual_seed(3)
    dy = (torch.randn(96, 160, generator=g) * torch.rand(96, 1, generator=g) * 4).bfloat16()
    dy[:16] = 0  # loss-masked tokens: all-zero rows and blocks
    row = MXFP8Spec(rule)
    h = HybridTensor.from_hp(dy, rowwise=row, columnwise=col,
                             generator=torch.Generator().manual_seed(11))
    mx = MXFP8Tensor.from_spec(dy, row)
    nv = NVFP4Tensor.from_spec(dy, dataclasses.replace(col, columnwise=True),
                               generator=torch.Generator().manual_seed(11))
    for got, want in zip(_bytes(h.rowwise) + _bytes(h.columnwise), _bytes(mx) + _bytes(nv)):
        assert torch.equal(got, want)
    assert h.columnwise.axis == "columnwise" and h.rowwise.axis == "rowwise"
    expected = "reference" if backend == "reference" else backends.quant_backend("cpu").value
    assert h.rowwise.quant_backend == h.columnwise.quant_backend == expected


def test_gradient_cast_shape_errors_name_the_rule():
    dy = torch.randn(40, 64, dtype=torch.bfloat16)  # 40 rows: not whole 16-row NVFP4 blocks
    with pytest.raises(ValueError, match="divisible by 16"):
        HybridTensor.from_hp(dy, rowwise=MXFP8Spec(), columnwise=NVFP4Spec())
