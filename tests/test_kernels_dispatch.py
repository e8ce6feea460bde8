"""The kernels' dispatch point: backend choice, torch.library.opcheck, torch.compile tracing,
input errors raised before any kernel runs, and the fallback when the extension is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import kernel_devices

from qtensor import backends
from qtensor.backends import BackendPolicy, QuantBackend
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed
from qtensor.ops import quant as Q
from qtensor.tensors import MXFP8Tensor, NVFP4Tensor

built = pytest.mark.skipif(Q.EXTENSION_ERROR is not None, reason="qtensor._C is not built")
DEVICES = kernel_devices()


def _op_samples(device):
    x = torch.randn(32, 64, device=device).bfloat16()
    sr = lambda seed, offset: torch.tensor([seed, offset], device=device)  # int64 (seed, offset)
    a = Q.amax(x)
    col_a = Q.amax(x, columnwise=True)
    s = torch.randint(0, 127, (40, 6), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    nv = Q.nvfp4_codes(x, a, NVFP4Spec(), None)
    mx = Q.mxfp8_both(x, "rceil", True, False)
    ops = torch.ops.qtensor
    return [
        (ops.amax.default, (x, True, False, True)),
        (ops.amax.default, (x, True, True, False)),
        (ops.nvfp4_quantize.default, (x, a, False, True, 2, 256, False, False, None)),
        (ops.nvfp4_quantize.default, (x, col_a, True, False, 0, 448, True, True, sr(3, 5))),
        (ops.mxfp8_quantize.default, (x, 1, True, True)),
        (ops.hybrid_quantize.default, (x, col_a, 0, 0, 448, False, True, sr(1, 0))),
        (ops.nvfp4_dequantize.default, (nv[0], nv[1], a, 448, torch.bfloat16)),
        (ops.mxfp8_dequantize.default, (mx[0], mx[1], False, torch.float32)),
        (ops.mxfp4_fake_quantize.default, (torch.randn(8, 64, device=device, requires_grad=True),)),
        (ops.swizzle_scale.default, (s,)),
        (ops.unswizzle_scale.default, (ops.swizzle_scale(s), 40, 6)),
    ]


@built
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device):
    for op, args in _op_samples(device):
        tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
        outs = op(*args)
        tensors = [t for t in (*args, *(outs if isinstance(outs, tuple) else (outs,)))
                   if isinstance(t, torch.Tensor)]
        # test_schema compares outputs with float math, which torch lacks for float8 on CPU.
        if not any(t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) for t in tensors):
            tests.append("test_schema")
        torch.library.opcheck(op, args, test_utils=tests)


@built
def test_backend_chosen_once_and_shown():
    assert Q.quant_backend("cpu") is QuantBackend.CPU
    t = NVFP4Tensor.from_hp(torch.randn(32, 64))
    assert t.quant_backend == "cpu" and "quant_backend=cpu" in repr(t)
    assert MXFP8Tensor.from_hp(torch.randn(32, 64)).quant_backend == "cpu"
    try:
        backends.set_policy(BackendPolicy(force_quant_reference=True))
        r = NVFP4Tensor.from_hp(torch.randn(32, 64))
        assert r.quant_backend == "reference"
    finally:
        backends.set_policy(None)
    assert Q.quant_backend("cpu") is QuantBackend.CPU


def test_policy_from_env_rejects_unknown():
    with pytest.raises(ValueError, match="QTENSOR_QUANT_BACKEND must be one of auto, reference"):
        BackendPolicy.from_env({"QTENSOR_QUANT_BACKEND": "fastest"})
    assert BackendPolicy.from_env({"QTENSOR_QUANT_BACKEND": "reference"}).force_quant_reference


def test_missing_extension_falls_back_to_reference():
    # A process where `import qtensor._C` fails still imports qtensor and quantizes.
    code = (
        "import sys; sys.modules['qtensor._C'] = None\n"
        "import torch, qtensor\n"
        "from qtensor.ops import quant\n"
        "t = qtensor.NVFP4Tensor.from_hp(torch.randn(32, 64))\n"
        "print(t.quant_backend, quant.EXTENSION_ERROR is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["reference", "True"]


@built
def test_kernel_tensors_equal_reference_tensors():
    x = torch.randn(64, 128).bfloat16()
    for spec in (NVFP4Spec(), NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)):
        k = NVFP4Tensor.from_spec(x, spec, generator=SRSeed(3, 0))
        try:
            backends.set_policy(BackendPolicy(force_quant_reference=True))
            r = NVFP4Tensor.from_spec(x, spec, generator=SRSeed(3, 0))
        finally:
            backends.set_policy(None)
        assert torch.equal(k.qdata, r.qdata) and torch.equal(k.dequantize(), r.dequantize())


@built
def test_compile_traces_the_ops():
    x = torch.randn(32, 64).bfloat16()

    def f(x):
        data, _ = Q.quantize_nvfp4(x, NVFP4Spec(fourover6="mae", e4m3_bound=256))
        mx, _ = Q.quantize_mxfp8(x, MXFP8Spec())
        return Q.dequantize_nvfp4(data.qdata, data.scale, data.amax, 256), mx.qdata

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    want = f(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))


@built
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_before_the_kernel(device):
    x = torch.randn(32, 64, device=device)
    a = Q.amax(x)
    ops = torch.ops.qtensor
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.amax(x.int(), False, False, False)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        ops.nvfp4_quantize(x[:, :24], a, False, False, 0, 448, False, False, None)
    with pytest.raises(RuntimeError, match="leading dims must be divisible by 16"):
        ops.nvfp4_quantize(x[:24], a, True, False, 0, 448, False, False, None)
    with pytest.raises(RuntimeError, match="e4m3_bound must be 448 or 256"):
        ops.nvfp4_quantize(x, a, False, False, 0, 300, False, False, None)
    with pytest.raises(RuntimeError, match="4over6 excludes RHT"):
        ops.nvfp4_quantize(x, a, True, False, 1, 448, True, False, None)
    with pytest.raises(RuntimeError, match="one value per quantized row"):
        ops.nvfp4_quantize(x, torch.ones(5, device=device), False, False, 0, 448, False, False, None)
    with pytest.raises(RuntimeError, match="divisible by 32"):
        ops.mxfp8_quantize(x[:, :48], 0, True, False)
    with pytest.raises(RuntimeError, match="fp16 cannot hold"):
        ops.mxfp4_fake_quantize(x.half())
    with pytest.raises(RuntimeError, match="rows padded to 128"):
        ops.unswizzle_scale(torch.zeros(128, 4, dtype=torch.uint8, device=device), 200, 4)
    with pytest.raises(RuntimeError, match="stochastic rounding needs sr_state"):
        ops.nvfp4_quantize(x, a, False, False, 0, 448, False, True, None)
    with pytest.raises(RuntimeError, match="int64 tensor of 2 elements"):
        ops.nvfp4_quantize(x, a, False, False, 0, 448, False, True, torch.zeros(3, device=device))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="input's device"):
            ops.nvfp4_quantize(x, a.cpu(), False, False, 0, 448, False, False, None)
        with pytest.raises(RuntimeError, match="input's device"):  # the kernel reads it there
            ops.nvfp4_quantize(x, a, False, False, 0, 448, False, True, torch.zeros(2).long())
