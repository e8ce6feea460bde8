"""The weight cache (eager and graph-safe) and quantize_(model, TrainingConfig(recipe))."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qtensor import NVFP4Tensor
from qtensor.training import GroupedLinear, NVFP4TrainingRecipe, TrainingLinear
from qtensor.training.weight_cache import leaves

RL = dict(rht=False, stochastic_rounding=False, weight_2d=False)
K, N = 64, 32


def bytes_of(op):
    return [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in leaves(op)]


def same_bytes(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def fresh_bytes(m):
    from qtensor.training.linear import quantize_weight

    return bytes_of(quantize_weight(m.weight.detach(), m.state.specs))


# ---- eager cache ---------------------------------------------------------------------------


def test_cache_rebuilds_once_per_optimizer_step():
    torch.manual_seed(0)
    m = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(dgrad_mxfp8=True))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x = torch.randn(32, K)
    m(x).sum().backward()
    first = m.weight_cache.operand
    m(x).sum().backward()  # second micro-batch: same weight, same operand
    assert m.weight_cache.operand is first
    opt.step()
    m(x)
    assert m.weight_cache.operand is not first
    assert same_bytes(bytes_of(m.weight_cache.operand), fresh_bytes(m))
    # Writes through .data are invisible to the version counter: invalidate() is the remedy.
    stale = m.weight_cache.operand
    m.weight.data.mul_(2)
    m(x)
    assert m.weight_cache.operand is stale
    m.weight_cache.invalidate()
    m(x)
    assert same_bytes(bytes_of(m.weight_cache.operand), fresh_bytes(m))


def test_is_first_microbatch_flags():
    torch.manual_seed(0)
    m = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RL))
    x = torch.randn(32, K)
    with pytest.raises(RuntimeError, match="nothing is cached"):
        m(x, is_first_microbatch=False)
    m(x, is_first_microbatch=True)
    kept = bytes_of(m.weight_cache.operand)
    with torch.no_grad():
        m.weight.add_(1.0)
    m(x, is_first_microbatch=False)  # reuse, even though the weight changed
    assert same_bytes(bytes_of(m.weight_cache.operand), kept)
    m(x, is_first_microbatch=True)
    assert same_bytes(bytes_of(m.weight_cache.operand), fresh_bytes(m))


def test_backward_of_an_earlier_microbatch_keeps_its_weight():
    torch.manual_seed(0)
    m = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RL))
    x = torch.randn(32, K, requires_grad=True)
    m(x).sum().backward()
    dx_alone = x.grad.clone()
    x.grad = None
    y1 = m(x)
    with torch.no_grad():
        m.weight.mul_(3.0)  # a new weight before micro-batch 1's backward
    m(x)  # rebuilds the cache (not in place)
    y1.sum().backward()
    assert torch.equal(x.grad, dx_alone)


# ---- graph-safe cache ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe", [NVFP4TrainingRecipe(**RL), NVFP4TrainingRecipe(dgrad_mxfp8=True)],
    ids=["nvfp4", "dgrad_mxfp8"],
)
def test_graph_safe_cache_honours_skip_flag(recipe):
    torch.manual_seed(0)
    m = TrainingLinear(K, N, recipe=recipe)
    m.skip_weight_update = torch.tensor(False)
    x = torch.randn(32, K)
    m(x)
    op = m.weight_cache.operand
    ptrs = [t.data_ptr() for t in leaves(op)]
    first = bytes_of(op)
    with torch.no_grad():
        m.weight.mul_(-2.0)
    # A replay that must reuse the first micro-batch's weight: same code path, flag True.
    m.skip_weight_update.fill_(True)
    m(x)
    assert m.weight_cache.operand is op and same_bytes(bytes_of(op), first)
    # The next step's first micro-batch: flag False, the same buffers get the new bytes.
    m.skip_weight_update.fill_(False)
    m(x)
    assert [t.data_ptr() for t in leaves(op)] == ptrs
    assert same_bytes(bytes_of(op), fresh_bytes(m)) and not same_bytes(first, fresh_bytes(m))


def test_skip_flag_must_be_a_bool_scalar():
    m = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RL))
    m.skip_weight_update = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one-element bool tensor"):
        m(torch.randn(32, K))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_reuses_first_microbatch_weight():
    torch.manual_seed(0)
    m = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RL), device="cuda",
                       dtype=torch.bfloat16)
    m.skip_weight_update = torch.tensor(False, device="cuda")
    x = torch.randn(32, K, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            m(x)  # warm-up allocates the cache
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = m(x)
    first = bytes_of(m.weight_cache.operand)
    with torch.no_grad():
        m.weight.mul_(-2.0)
    m.skip_weight_update.fill_(True)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(bytes_of(m.weight_cache.operand), first)
    m.skip_weight_update.fill_(False)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(bytes_of(m.weight_cache.operand), fresh_bytes(m))
    assert torch.isfinite(y).all()


# ---- quantize_ -----------------------------------------------------------------------------


def test_quantize_with_training_config():
    torchao_quant = pytest.importorskip("torchao.quantization")
    from qtensor.training import TrainingConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, 64), nn.ReLU(), nn.Linear(64, N), nn.Linear(N, 8))
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = NVFP4TrainingRecipe(dgrad_mxfp8=True)
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        torchao_quant.quantize_(model, TrainingConfig(recipe))
    torchao_quant.quantize_(model, TrainingConfig(recipe, skip_incompatible=True))
    assert [type(l).__name__ for l in model] == ["TrainingLinear", "ReLU", "TrainingLinear",
                                                 "Linear"]
    assert list(model.parameters()) == params  # shared: the optimizer still owns them
    assert (model[0].state.seeds.index, model[2].state.seeds.index) == (0, 1)
    x = torch.randn(32, K)
    model(x).square().sum().backward()
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model[0].weight)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_quantize_sets_grouped_linear_recipe():
    torchao_quant = pytest.importorskip("torchao.quantization")
    from qtensor.training import TrainingConfig

    moe = nn.ModuleDict({"experts": GroupedLinear(4, K, N, recipe=NVFP4TrainingRecipe())})
    recipe = NVFP4TrainingRecipe(dgrad_mxfp8=True, row_scaled_activation=True, **RL)
    torchao_quant.quantize_(moe, TrainingConfig(recipe),
                            filter_fn=lambda m, name: isinstance(m, GroupedLinear))
    assert moe["experts"].recipe == recipe
    with pytest.raises(TypeError, match="NVFP4TrainingRecipe"):
        TrainingConfig(recipe="nvfp4")
    with pytest.raises(TypeError, match="high-precision master weight"):
        lin = nn.Linear(K, N)
        lin.weight = nn.Parameter(NVFP4Tensor.from_hp(lin.weight.detach()), requires_grad=False)
        TrainingLinear.from_linear(lin, recipe)
