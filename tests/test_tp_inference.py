"""Tensor parallelism with quantized weights on 2 gloo ranks.

Column-wise: the output equals the unsharded model bitwise (each rank computes whole output
columns). Column- then row-wise (the Megatron MLP): the row-wise layer sums two partial
products in bf16, so the bound is a couple of bf16 ulps of the output, not bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate

from qtensor import MXFP8Tensor, NVFP4Spec, NVFP4Tensor
from qtensor.distributed.tp import plan_problems
from qtensor.testing.launch import run_local

KINDS = {
    "nvfp4_2d": lambda w: NVFP4Tensor.from_hp(w, block_2d=True),
    "nvfp4_rowscaled": lambda w: NVFP4Tensor.from_hp(w, row_scaled=True),
    "mxfp8": lambda w: MXFP8Tensor.from_hp(w),
}


def mlp(kind: str, hidden: int = 128) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 64))
    model = model.to(torch.bfloat16)
    for lin in (model[0], model[2]):
        lin.weight = nn.Parameter(KINDS[kind](lin.weight.detach()), requires_grad=False)
    return model


def tp_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from qtensor.distributed.tp import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    out = {}
    for kind in KINDS:
        model = mlp(kind)
        ref = model(x)
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(model, mesh, plan)
        local = model[0].weight.to_local()
        y = model(x)
        out[kind] = {
            "local": (type(local).__name__, tuple(local.shape)),
            "diff": (y.float() - ref.float()).abs().max().item(),
            "scale": ref.float().abs().max().item(),
        }
        model = mlp(kind)
        parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate())})
        out[kind]["colwise_equal"] = torch.equal(model[0](x), mlp(kind)[0](x))
    return out


@pytest.fixture(scope="module")
def tp_results():
    return run_local(tp_worker, 2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_colwise_is_bitwise(tp_results, kind):
    for res in tp_results:
        assert res[kind]["colwise_equal"]
        assert res[kind]["local"] == (type(KINDS[kind](torch.ones(32, 64))).__name__, (64, 64))


@pytest.mark.parametrize("kind", list(KINDS))
def test_colwise_rowwise_mlp_within_bf16_rounding(tp_results, kind):
    for res in tp_results:
        # Two bf16 partial sums added: at most ~2 ulps (2 * 2^-8 relative) of the output scale.
        assert res[kind]["diff"] <= 2 * 2 ** -8 * res[kind]["scale"]


def test_plan_cutting_blocks_is_refused_with_the_name():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = mlp("nvfp4_2d", hidden=48)  # 24 rows per rank cut the 16x16 tiles
    problems = plan_problems(model, {"0": ColwiseParallel(), "2": RowwiseParallel()}, 2)
    assert len(problems) == 2
    assert problems[0].startswith("0.weight (NVFP4Tensor, shape (48, 64)): ColwiseParallel "
                                  "splits dim 0 of 48 into 2 shards; each must be a multiple "
                                  "of 16")
    assert problems[1].startswith("2.weight (NVFP4Tensor, shape (64, 48)): RowwiseParallel")
    mx = mlp("mxfp8", hidden=64)  # K = 64 over 4 ranks: 16-column shards cut 32-blocks
    assert "multiple of 32" in plan_problems(mx, {"2": RowwiseParallel()}, 4)[0]


def test_dynamic_activation_weights_are_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = mlp("nvfp4_2d")
    model[0].weight = nn.Parameter(model[0].weight.replace(act_spec=NVFP4Spec()),
                                   requires_grad=False)
    (problem,) = plan_problems(model, {"0": ColwiseParallel()}, 2)
    assert "quantizes its activation" in problem and "weight-only config" in problem
