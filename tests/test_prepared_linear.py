"""[Note: prepared linear] (qtensor/gemm/dense.py): the eager decode path of a weight-only linear
launches the op's kernels with the op's arguments, so its results are the op's bit for bit; it
is reused per weight and activation layout, follows in-place changes of the weight's bytes and
amax, gives way to the op wherever autograd, a mode or compilation needs it, and is dropped
with its weight. The op it is checked against is called through the dispatcher, which never
takes the prepared path.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from qtensor import MXFP8Tensor, NVFP4Tensor
from qtensor.gemm import dense as gemm
from qtensor.ops import gemm_ops
from qtensor.ops.gemm_operands import MXFP8, NVFP4, Side

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMATS = {"nvfp4": NVFP4Tensor, "mxfp8": MXFP8Tensor}


def op_linear(x, w, bias):
    """F.linear(x, w, bias) through the dispatcher: torch.ops.qtensor.<fmt>_mm itself."""
    fmt = NVFP4 if type(w) is NVFP4Tensor else MXFP8
    b = Side(w.qdata, w.scale, w.amax, w.e4m3_bound) if fmt == NVFP4 else Side(w.qdata, w.scale)
    x2 = x.reshape(-1, x.shape[-1])
    out = gemm_ops.op(f"{fmt}_mm")(*gemm_ops.dense_args(fmt, Side(x2), b, bias, x.dtype))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def plans_of(w) -> dict:
    entry = gemm._PLANS.get(id(w))
    return {} if entry is None or entry[0]() is not w else entry[1]


def _weights(fmt, n=256, k=2048, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    return FORMATS[fmt].from_hp(w), bias, g


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_prepared_linear_equals_the_op_bitwise(fmt):
    w, bias, g = _weights(fmt)
    with torch.no_grad():
        for shape in [(1, 2048), (7, 2048), (64, 2048), (2, 3, 2048), (1, 1, 2048)]:
            for b in (None, bias):
                x = torch.randn(shape, device="cuda", generator=g).bfloat16()
                out = F.linear(x, w, b)
                ref = op_linear(x, w, b)
                assert out.shape == ref.shape and out.is_contiguous(), shape
                assert torch.equal(out, ref), (shape, b is not None)
    assert len(plans_of(w)) == 10  # one per (shape, bias)
    assert all(p[0] is not None for p in plans_of(w).values())


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_prepared_linear_is_reused_and_follows_the_weights_bytes(fmt):
    w, bias, g = _weights(fmt, seed=1)
    x = torch.randn(4, 2048, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        first = F.linear(x, w, bias)
        second = F.linear(x, w, bias)
        assert len(plans_of(w)) == 1 and torch.equal(first, second)
        # In place: new bytes and (NVFP4) a new amax reach the next call.
        other = FORMATS[fmt].from_hp(torch.randn(256, 2048, device="cuda", generator=g))
        w.qdata.copy_(other.qdata)
        w.scale.copy_(other.scale)
        if fmt == "nvfp4":
            w.amax.copy_(other.amax)
        changed = F.linear(x, w, bias)
        assert torch.equal(changed, op_linear(x, other, bias))
        assert not torch.equal(changed, first)
        # A replaced inner tensor gets a new plan rather than the old bytes.
        w.qdata = other.qdata.clone()
        w.qdata[0].zero_()
        assert torch.equal(F.linear(x, w, bias), op_linear(x, w, bias))
        assert len(plans_of(w)) == 1


@pytest.mark.cuda
@needs_cuda
def test_prepared_linear_gives_way_to_the_op():
    w, bias, g = _weights("nvfp4", seed=2)
    x = torch.randn(3, 2048, device="cuda", generator=g).bfloat16()
    # Autograd to record: the op's autograd gives x its gradient.
    xg = x.clone().requires_grad_(True)
    out = F.linear(xg, w, bias)
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert xg.grad is not None and not plans_of(w)
    # More rows than the decode path, a non-contiguous activation, fp32: no plan, same op.
    with torch.no_grad():
        for x2 in (torch.randn(65, 2048, device="cuda", generator=g).bfloat16(),
                   torch.randn(2048, 8, device="cuda", generator=g).bfloat16().t(),
                   torch.randn(2, 2048, device="cuda", generator=g)):
            assert torch.equal(F.linear(x2, w, bias), op_linear(x2, w, bias))
    assert all(p[0] is None for p in plans_of(w).values())


@pytest.mark.cuda
@needs_cuda
def test_prepared_linear_records_into_a_cuda_graph_and_is_dropped_with_its_weight():
    w, bias, g = _weights("mxfp8", seed=3)
    x = torch.randn(1, 2048, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        F.linear(x, w, bias)  # warm-up: compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = F.linear(x, w, bias)
        x.copy_(torch.randn(1, 2048, device="cuda", generator=g).bfloat16())
        graph.replay()
        assert torch.equal(out, op_linear(x, w, bias))
    key = id(w)
    assert key in gemm._PLANS
    del w, out, graph
    gc.collect()
    assert key not in gemm._PLANS


def test_cpu_weights_take_no_plan():
    w = NVFP4Tensor.from_hp(torch.randn(64, 128))
    x = torch.randn(2, 128)
    with torch.no_grad():
        out = F.linear(x, w)
    assert id(w) not in gemm._PLANS
    assert torch.equal(out, op_linear(x, w, None))
