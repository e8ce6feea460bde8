"""FSDP2 training with the NVFP4 recipe: master shards stay high precision, each weight is
quantized with its global amax before the all-gather (one all-reduce for all amaxes a step).

On 2 gloo ranks, both fed the same batch, a sharded model must match the unsharded one bitwise:
outputs, every gradient shard, and after two SGD steps the weights and the second outputs too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qtensor import NVFP4Tensor
from qtensor.distributed.master import columnwise_from_2d
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.testing.collectives import CollectiveCounter
from qtensor.testing.launch import run_local

RECIPES = {
    "nvfp4_2d": {},  # default: 2D weight tiles, RHT and stochastic rounding on gradients
    "dgrad_mxfp8": dict(dgrad_mxfp8=True),
    "nvfp4_1d": dict(weight_2d=False),  # the columnwise side is gathered too
}


def build(recipe: str) -> nn.Module:
    from qtensor import quantize_
    from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 128))  # fp32 masters
    return quantize_(model, TrainingConfig(NVFP4TrainingRecipe(**RECIPES[recipe])))


def test_columnwise_from_2d_is_the_columnwise_quantization():
    w = torch.randn(64, 96)
    amax = w.abs().amax()
    row = NVFP4Tensor.from_spec(w, NVFP4Spec(block_2d=True), global_amax=amax)
    col = NVFP4Tensor.from_spec(w, NVFP4Spec(block_2d=True, columnwise=True))
    derived = columnwise_from_2d(row)
    assert derived.axis == col.axis and derived.shape == col.shape
    assert torch.equal(derived.qdata, col.qdata)
    assert torch.equal(derived.scale.view(torch.uint8), col.scale.view(torch.uint8))


def test_high_precision_override_is_refused():
    from qtensor import quantize_
    from qtensor.distributed import quantize_on_gather
    from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

    model = quantize_(nn.Sequential(nn.Linear(64, 64)), TrainingConfig(
        NVFP4TrainingRecipe(backward_override="high_precision")))
    with pytest.raises(ValueError, match="0: backward_override='high_precision'"):
        quantize_on_gather(model)


def train_two_steps(rank, world, recipe, reshard, device="cpu"):
    from qtensor.distributed import fully_shard, precompute_amaxes, quantize_on_gather

    ref, model = build(recipe).to(device), quantize_on_gather(build(recipe).to(device))
    for lin in (model[0], model[2]):
        fully_shard(lin, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    result = {"equal": [], "stale": None}
    for step in range(2):
        x = torch.randn(32, 64, dtype=torch.bfloat16, generator=gen).to(device)
        with CollectiveCounter("all_reduce", 0) as reduces:
            precompute_amaxes(model)
        with CollectiveCounter() as gathers:
            y = model(x)
        y_ref = ref(x)
        y.float().pow(2).sum().backward()
        y_ref.float().pow(2).sum().backward()
        checks = [torch.equal(y, y_ref)]
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            rows = p_ref.shape[0] // world
            checks.append(torch.equal(p.grad.to_local(), p_ref.grad[rows * rank:rows * (rank + 1)]))
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            rows = p_ref.shape[0] // world
            local = p.to_local()
            local = getattr(local, "_data", local)
            checks.append(torch.equal(local, p_ref.detach()[rows * rank:rows * (rank + 1)]))
        result["equal"].append(checks)
        result.setdefault("all_reduces", []).append(len(reduces.calls))
        result.setdefault("forward_gather_bytes", []).append(gathers.bytes)
    try:  # the weights changed in the last step and no amax was recomputed
        model(torch.randn(32, 64, dtype=torch.bfloat16, device=device))
    except RuntimeError as err:
        result["stale"] = str(err)
    return result


def training_worker(rank, world, device="cpu"):
    runs = {(r, True): train_two_steps(rank, world, r, True, device) for r in RECIPES}
    runs[("nvfp4_2d", False)] = train_two_steps(rank, world, "nvfp4_2d", False, device)
    return runs


@pytest.fixture(scope="module")
def runs():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_local(training_worker, 2)


@pytest.mark.parametrize("recipe,reshard", [(r, True) for r in RECIPES] + [("nvfp4_2d", False)])
def test_sharded_training_matches_unsharded(runs, recipe, reshard):
    for rank_runs in runs:
        res = rank_runs[(recipe, reshard)]
        for step, checks in enumerate(res["equal"]):
            assert all(checks), f"step {step}: {checks} (output, 4 grads, 4 weights)"
        assert res["all_reduces"] == [1, 1]  # every weight's amax in one collective


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_all_gather_moves_quantized_weights(runs, recipe):
    res = runs[0][(recipe, True)]
    gathered = res["forward_gather_bytes"][0]  # the two Linears' all-gathers of a forward
    rows = (32, 64)  # each rank's rows of the [64, 64] and [128, 64] weights
    bias = sum(4 * r for r in rows)  # fp32 bias shards ride along
    bf16 = sum(2 * r * 64 for r in rows)
    nvfp4 = sum(r * 64 * (0.5 + 1 / 16) for r in rows)  # codes + E4M3 scales (docs/formats.md)
    expected = 2 * nvfp4 if recipe == "nvfp4_1d" else nvfp4  # 1x16: both sides move
    assert sum(gathered) == expected + bias
    if recipe != "nvfp4_1d":
        assert (sum(gathered) - bias) / bf16 <= 0.3


def test_stale_amax_is_refused(runs):
    message = runs[0][("nvfp4_2d", True)]["stale"]
    assert message is not None and "stale (the weight changed since)" in message
    assert "precompute_amaxes(model)" in message
