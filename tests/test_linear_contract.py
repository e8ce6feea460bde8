"""What a quantized linear owes its caller, as nn.Linear does: gradients where autograd asks for
them, a fresh output tensor (never a view), empty batches, and a compile that works as the
first thing a process does.

The gradient oracle for dynamic activations is the straight-through rule documented on
qtensor.gemm.dense.DynamicActivationLinear: dX = dY @ W_decoded in fp64, d bias = sum dY.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import qtensor
from qtensor import qat
from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

DYNAMIC = {
    "nvfp4_dynamic": qtensor.NVFP4DynamicActivationNVFP4WeightConfig,
    "mxfp8_dynamic": qtensor.MXFP8DynamicActivationMXFP8WeightConfig,
}
INFERENCE = {**DYNAMIC, "nvfp4_weight_only": qtensor.NVFP4WeightOnlyConfig,
             "mxfp8_weight_only": qtensor.MXFP8WeightOnlyConfig}


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(dtype)


@pytest.mark.parametrize("name", list(INFERENCE))
def test_every_input_and_bias_gets_its_gradient(name):
    model = qtensor.quantize_(mlp(), INFERENCE[name]())
    x = torch.randn(2, 3, 256, requires_grad=True)
    model(x).square().sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    for i in (0, 2):
        assert model[i].bias.grad is not None, f"layer {i} bias has no gradient"


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_dynamic_activation_gradient_is_straight_through(name):
    torch.manual_seed(1)
    layer = nn.Linear(128, 96)
    qtensor.quantize_(nn.Sequential(layer), DYNAMIC[name]())
    x = torch.randn(5, 7, 128, requires_grad=True)
    y = layer(x)
    dy = torch.randn(y.shape)
    y.backward(dy)
    w = layer.weight.dequantize(torch.float64)
    ref = dy.double() @ w
    err = ((x.grad.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6, f"dX relative error {err:.2e}"
    assert torch.allclose(layer.bias.grad.double(), dy.double().sum((0, 1)), rtol=1e-5)
    with torch.no_grad():  # the forward is the inference path, bit for bit
        assert torch.equal(y.detach(), layer(x))


@pytest.mark.parametrize("name", list(INFERENCE))
def test_inference_outputs_are_fresh_tensors(name):
    model = qtensor.quantize_(mlp(torch.bfloat16), INFERENCE[name]())
    with torch.no_grad():
        for shape in ((4, 256), (2, 3, 256)):
            y = model[0](torch.randn(shape, dtype=torch.bfloat16))
            assert y._base is None, f"{shape}: the output is a view"


@pytest.mark.parametrize("make", [
    lambda m: qtensor.quantize_(m, TrainingConfig(NVFP4TrainingRecipe())),
    lambda m: qat.quantize_(m, qat.MXFP4QATConfig()),
    lambda m: qtensor.quantize_(m, qtensor.NVFP4DynamicActivationNVFP4WeightConfig()),
], ids=["training", "qat", "dynamic"])
def test_in_place_ops_on_outputs_train(make):
    torch.manual_seed(2)
    model = make(nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, 64))
                 .to(torch.bfloat16))
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    h = model(x)
    h += x  # a residual added in place
    h.float().square().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("name", list(INFERENCE))
def test_empty_batches_multiply_like_nn_linear(name):
    model = qtensor.quantize_(mlp(torch.bfloat16), INFERENCE[name]())
    with torch.no_grad():
        assert model(torch.empty(0, 256, dtype=torch.bfloat16)).shape == (0, 256)
        assert model(torch.empty(2, 0, 256, dtype=torch.bfloat16)).shape == (2, 0, 256)


def test_dynamic_activation_training_step_compiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    model = qtensor.quantize_(mlp(torch.bfloat16), qtensor.NVFP4DynamicActivationNVFP4WeightConfig())
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    grads = []
    for fn in (model, compiled):
        xi = x.clone().requires_grad_(True)
        fn(xi).float().square().sum().backward()
        grads.append(xi.grad)
    assert counter.frame_count == 1
    assert torch.equal(grads[0], grads[1])


FRESH = textwrap.dedent("""
    import torch
    from torch import nn
    from torch._dynamo.testing import CompileCounterWithBackend
    import qtensor
    from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(torch.bfloat16)
    model = qtensor.quantize_(model, {config})
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(model, backend=counter, fullgraph=True)
    for i in range(3):
        x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        step(x).float().sum().backward()
    print("frames", counter.frame_count)
""")


@pytest.mark.parametrize("config", [
    "TrainingConfig(NVFP4TrainingRecipe())",
    "qtensor.NVFP4DynamicActivationNVFP4WeightConfig()",
], ids=["training", "dynamic"])
def test_compile_is_the_first_thing_a_process_does(config):
    """No eager quantization runs before the compiled step: the backend choices must be settled
    at trace time without guards that the first eager call would invalidate."""
    out = subprocess.run([sys.executable, "-c", FRESH.format(config=config)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "frames 1", out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("form", ["@", "mm", "matmul", "addmm", "method", "left", "bmm"])
def test_products_of_quantized_operands_give_gradients(form):
    """mm, bmm, matmul, @ and addmm with a quantized operand give the high-precision operand its
    gradient (they raised in the backward before, from aten's formula)."""
    torch.manual_seed(3)
    w = qtensor.NVFP4Tensor.from_hp(torch.randn(32, 64), row_scaled=True)
    x = torch.randn(4, 64, requires_grad=True)
    w3 = qtensor.MXFP8Tensor.from_hp(torch.randn(2, 32, 64))
    x3 = torch.randn(2, 4, 64, requires_grad=True)
    run = {
        "@": lambda: x @ w.t(), "mm": lambda: torch.mm(x, w.t()),
        "matmul": lambda: torch.matmul(x, w.t()), "method": lambda: x.mm(w.t()),
        "addmm": lambda: torch.addmm(torch.zeros(32), x, w.t()),
        "left": lambda: (w @ x.t()).t(), "bmm": lambda: torch.bmm(x3, w3.transpose(-1, -2)),
    }[form]
    y = run()
    dy = torch.randn(y.shape)
    y.backward(dy)
    if form == "bmm":
        ref, got = dy.double() @ w3.dequantize(torch.float64), x3.grad
    else:
        ref, got = dy.double() @ w.dequantize(torch.float64), x.grad
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6, f"{form}: dX relative error {err:.2e}"
