"""MXFP4QATLinear end to end: modes, overrides, cache paths, STE, rejections, export."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from qtensor.formats import fp8_block, mxfp8
from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.qat import (
    MXFP4QATConfig,
    MXFP4QATLinear,
    decode_weight,
    export_state_dict,
    export_weight,
    quantize_,
)
from qtensor.qat import convert
from qtensor.training.weight_cache import leaves

HOSTS = ("mxfp8", "fp8_block128")
OVERRIDES = (None, "high_precision", "dequantized")
N, K, M = 128, 256, 128


def make_model(host, direct, override, dtype=torch.bfloat16, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=g))
    model = nn.Sequential(lin)
    quantize_(model, MXFP4QATConfig(host=host, direct=direct, backward_override=override, **kw))
    return model


def inputs(seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, M // 2, K, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(2, M // 2, N, generator=g).to(dtype)
    return x, dy


def step(model, x, dy, **fwd_kw):
    x = x.detach().clone().requires_grad_()
    y = model[0](x, **fwd_kw)
    model.zero_grad(set_to_none=True)
    y.backward(dy)
    lin = model[0]
    return [y, x.grad, lin.weight.grad, lin.bias.grad]


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("host,override", list(itertools.product(HOSTS, OVERRIDES)))
def test_direct_equals_projection_on_miss_hit_update(host, override):
    models = [make_model(host, direct, override) for direct in (False, True)]
    x, dy = inputs()
    x2, dy2 = inputs(seed=2)
    for m in models:  # miss
        m.outs = [step(m, x, dy)]
    for m in models:  # hit: same weight, another micro-batch
        m.outs.append(step(m, x2, dy2, is_first_microbatch=False))
        m.outs.append(step(m, x2, dy2))
    for m in models:  # update: an optimizer step moves the weight in place
        with torch.no_grad():
            m[0].weight.add_(torch.linspace(-0.02, 0.03, N * K).reshape(N, K).to(m[0].weight))
        m.outs.append(step(m, x, dy))
        m.outs.append(step(m, x2, dy2, is_first_microbatch=True))
    for a, b in zip(models[0].outs, models[1].outs):
        for ta, tb in zip(a, b):
            assert bits_equal(ta, tb)
    for m in models:
        assert dict(m[0].weight_cache.stats) == {"miss": 1, "hit": 2, "update": 2}
    # The update really changed the result (the cache did not serve the old weight).
    assert not torch.equal(models[0].outs[0][0], models[0].outs[3][0])


def host_round_trip(t, host, columnwise):
    """Decoded host quantization of t, written with the format references directly."""
    if host == "mxfp8":
        q, s = mxfp8.quantize(t, MXFP8Spec(columnwise=columnwise))
        return mxfp8.dequantize(q, s, columnwise)
    spec = FP8BlockSpec("1x128", columnwise)
    return fp8_block.dequantize(*fp8_block.quantize(t, spec), spec)


@pytest.mark.parametrize("host", HOSTS)
def test_gemms_match_independent_reference(host):
    model = make_model(host, False, None)
    x, dy = inputs()
    y, dx, dw, db = step(model, x, dy)
    w_hat = convert.project(model[0].weight).float()
    x2, dy2 = x.detach().reshape(M, K), dy.reshape(M, N)
    y_ref = (host_round_trip(x2, host, False) @ w_hat.t() + model[0].bias.float()).bfloat16()
    torch.testing.assert_close(y.reshape(M, N), y_ref, atol=0, rtol=0)
    if host == "mxfp8":
        w_dgrad = host_round_trip(w_hat, host, True)  # fresh 32x1 quantization of w^
    else:
        w_dgrad = w_hat  # 128x128 tiles hold w^ exactly at these spreads
    dx_ref = (host_round_trip(dy2, host, False) @ w_dgrad).bfloat16()
    torch.testing.assert_close(dx.reshape(M, K), dx_ref, atol=0, rtol=0)
    dw_ref = host_round_trip(dy2, host, True).t() @ host_round_trip(x2, host, True)
    torch.testing.assert_close(dw, dw_ref.bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(db, dy2.float().sum(0).bfloat16(), atol=0, rtol=0)
    # Negative control: the quantized dgrad is not the dequantized-override dgrad.
    dq = step(make_model(host, False, "dequantized"), x, dy)
    assert not torch.equal(dq[1], dx)
    torch.testing.assert_close(dq[1].reshape(M, K), (dy2 @ w_hat.bfloat16()), atol=0, rtol=0)


def test_high_precision_dgrad_uses_master_weight():
    model = make_model("mxfp8", True, "high_precision")
    x, dy = inputs()
    _, dx, dw, _ = step(model, x, dy)
    w = model[0].weight.detach()
    dy2 = dy.reshape(M, N)
    torch.testing.assert_close(dx.reshape(M, K), dy2 @ w, atol=0, rtol=0)
    assert not torch.equal(dx.reshape(M, K), dy2 @ convert.project(w))
    torch.testing.assert_close(dw, dy2.t() @ x.detach().reshape(M, K), atol=0, rtol=0)


@pytest.mark.parametrize("host", HOSTS)
def test_ste_reaches_grad_and_main_grad(host):
    x, dy = inputs()
    plain = make_model(host, True, None, dtype=torch.float32)
    ref = step(plain, x.float(), dy.float())[2]
    assert ref is not None and ref.dtype == torch.float32 and ref.abs().sum() > 0
    fused = make_model(host, True, None, dtype=torch.float32, fuse_wgrad_accumulation=True)
    w = fused[0].weight
    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    for _ in range(2):
        out = fused[0](x.float().detach())
        out.backward(dy.float())
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, 2 * ref, atol=0, rtol=0)
    del w.main_grad
    with pytest.raises(RuntimeError, match="main_grad"):
        fused[0](x.float())


def test_recipe_switch_invalidates_cache():
    model = make_model("mxfp8", False, None)
    x, dy = inputs()
    step(model, x, dy)
    for host, direct, override in (("mxfp8", True, None), ("fp8_block128", True, None),
                                   ("fp8_block128", True, "dequantized")):
        model[0].qat_config = MXFP4QATConfig(host=host, direct=direct, backward_override=override)
        got = step(model, x, dy)
        fresh = make_model(host, direct, override)
        for a, b in zip(got, step(fresh, x, dy)):
            assert bits_equal(a, b)
    assert model[0].weight_cache.stats["miss"] == 4


@pytest.mark.parametrize("direct", [False, True])
def test_skip_update_gate_keeps_first_microbatch_weight(direct):
    model = make_model("fp8_block128", direct, None)
    lin = model[0]
    x, dy = inputs()
    y0 = lin(x.detach(), is_first_microbatch=True)
    before = [t.clone() for t in leaves(lin.weight_cache.operand)]
    with torch.no_grad():
        lin.weight.mul_(1.5)
    y_skip = lin(x.detach(), skip_update=torch.tensor(True))
    assert bits_equal(y_skip, y0)
    for b, t in zip(before, leaves(lin.weight_cache.operand)):
        assert bits_equal(b, t)
    y_new = lin(x.detach(), skip_update=torch.tensor(False))
    assert not torch.equal(y_new, y0)
    assert bits_equal(y_new, lin(x.detach(), is_first_microbatch=True))
    assert lin.weight_cache.stats["gated_update"] == 2
    with pytest.raises(TypeError, match="0-d bool tensor"):
        lin(x.detach(), skip_update=True)


def test_fp16_and_unsupported_surfaces_rejected():
    lin16 = nn.Sequential(nn.Linear(K, N).half())
    with pytest.raises(TypeError, match="fp16 cannot hold the MXFP4 grid"):
        quantize_(lin16, MXFP4QATConfig())
    model = make_model("mxfp8", False, None)
    x, _ = inputs()
    with pytest.raises(TypeError, match="bf16 or fp32"):
        model(x.detach().half())
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(TypeError, match="autocast"):
            model(x.detach())
    with pytest.raises(TypeError, match="nn.Linear only"):
        from qtensor.qat.config import apply_qat

        apply_qat(nn.Conv1d(4, 4, 1), MXFP4QATConfig())
    with pytest.raises(TypeError, match="nn.Linear only"):  # MHA calls F.linear on out_proj
        quantize_(nn.MultiheadAttention(128, 4), MXFP4QATConfig())
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_(nn.Sequential(nn.Linear(96, 128)), MXFP4QATConfig(host="fp8_block128"))
    kept = quantize_(nn.Sequential(nn.Linear(96, 128)),
                     MXFP4QATConfig(host="fp8_block128", skip_incompatible=True))
    assert type(kept[0]) is nn.Linear
    with pytest.raises(ValueError, match="tokens"):
        model(torch.randn(3, K, dtype=torch.bfloat16))
    q = nn.Sequential(nn.Linear(K, N))
    q[0].weight = nn.Parameter(q[0].weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(TypeError, match="primary quantized weight"):
        quantize_(q, MXFP4QATConfig())
    with pytest.raises(ValueError, match="host must be one of"):
        MXFP4QATConfig(host="nvfp4")
    with pytest.raises(ValueError, match="backward_override"):
        MXFP4QATConfig(backward_override="fp32")


def test_bf16_autocast_with_fp32_master_weights():
    model = make_model("fp8_block128", True, None, dtype=torch.float32)
    x, dy = inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    assert x.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32


def test_from_env_and_torchao_registry():
    cfg = MXFP4QATConfig.from_env({"QTENSOR_MXFP4_QAT_HOST": "FP8_block128",
                                   "QTENSOR_MXFP4_QAT_DIRECT": "1",
                                   "QTENSOR_MXFP4_QAT_BACKWARD_OVERRIDE": "none"})
    assert (cfg.host, cfg.direct, cfg.backward_override) == ("fp8_block128", True, None)
    with pytest.raises(ValueError, match="QTENSOR_MXFP4_QAT_DIRECT"):
        MXFP4QATConfig.from_env({"QTENSOR_MXFP4_QAT_DIRECT": "maybe"})
    from torchao.quantization import quantize_ as ao_quantize_

    model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, N))
    ao_quantize_(model, cfg)
    assert isinstance(model[0], MXFP4QATLinear) and isinstance(model[2], MXFP4QATLinear)
    assert "host=fp8_block128, direct=True" in repr(model[0])


@pytest.mark.parametrize("host", HOSTS)
def test_export_decodes_to_training_weight(host):
    model = make_model(host, True, None)
    x, dy = inputs()
    step(model, x, dy)
    with torch.no_grad():
        model[0].weight.sub_(0.1 * model[0].weight.grad)
    y = model[0](x.detach())
    sd = export_state_dict(model)
    assert set(sd) == {"0.bias", "0.weight_blocks", "0.weight_scales"}
    blocks, scales = sd["0.weight_blocks"], sd["0.weight_scales"]
    assert blocks.shape == (N, K // 32, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (N, K // 32) and scales.dtype == torch.uint8
    decoded = decode_weight(blocks, scales)
    assert torch.equal(decoded, convert.project(model[0].weight).float())
    # ... and to the very values the last forward multiplied.
    assert torch.equal(decoded, model[0].weight_cache.operand.dequantize(torch.float32))
    assert y.shape == (2, M // 2, N)
    bad = model[0].weight.detach().clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        export_weight(bad, "0.weight")
    with pytest.raises(ValueError, match="no MXFP4QATLinear"):
        export_state_dict(nn.Sequential(nn.Linear(K, N)))


def test_qat_runs_the_training_stack():
    """One autograd linear and one weight cache: the QAT linear's graph node and cache are the
    NVFP4 training linear's, and its cached weight operand is a tensor class of the stack."""
    from qtensor.tensors import FP8BlockTensor, HybridTensor, MXFP8Tensor
    from qtensor.training import NVFP4TrainingRecipe, TrainingLinear, WeightCache

    x, _ = inputs()
    nv = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(stochastic_rounding=False),
                        dtype=torch.bfloat16)
    kinds = {("mxfp8", None): HybridTensor, ("mxfp8", "dequantized"): MXFP8Tensor,
             ("fp8_block128", None): FP8BlockTensor}
    for (host, override), cls in kinds.items():
        qat = make_model(host, False, override)[0]
        y_qat, y_nv = qat(x), nv(x)
        assert type(y_qat.grad_fn) is type(y_nv.grad_fn)
        assert type(y_qat.grad_fn).__name__ == "TrainingLinearFunctionBackward"
        assert type(qat.weight_cache) is type(nv.weight_cache) is WeightCache
        assert type(qat.weight_cache.operand) is cls
    tiles = make_model("fp8_block128", True, None)[0]
    tiles(x)
    assert tiles.weight_cache.operand.block == "128x128"  # one tile tensor: fprop and dgrad


def test_reuse_on_an_empty_cache_converts():
    """MXFP4QATLinear documents that is_first_microbatch=False on an empty cache converts (the
    training linears raise instead: tests/test_training_modules.py)."""
    model = make_model("mxfp8", False, None)
    x, dy = inputs()
    got = step(model, x, dy, is_first_microbatch=False)
    assert dict(model[0].weight_cache.stats) == {"miss": 1}
    for a, b in zip(got, step(make_model("mxfp8", False, None), x, dy)):
        assert bits_equal(a, b)


def test_native_backend_reaches_every_operand(monkeypatch):
    """native_gemm's scaled_mm choice is carried by the weight, activation and gradient operands
    (off CUDA the planner then runs the op's reference: the same bits as the emulation)."""
    from qtensor.backends import GemmBackend
    from qtensor.gemm import dense
    from qtensor.qat import hosts

    x, dy = inputs()
    want = step(make_model("fp8_block128", True, None, native_gemm=False), x, dy)
    monkeypatch.setattr(hosts, "gemm_backend", lambda *a, **k: GemmBackend.SCALED_MM)
    seen = []
    real_plan = dense.plan
    monkeypatch.setattr(dense, "plan", lambda a, b, *r, **k: seen.append(
        (a.gemm_backend, b.gemm_backend)) or real_plan(a, b, *r, **k))
    model = make_model("fp8_block128", True, None, native_gemm=True)
    got = step(model, x, dy)
    assert model[0].weight_cache.operand.gemm_backend == "scaled_mm"
    assert seen == [("scaled_mm", "scaled_mm")] * 3  # fprop, dgrad, wgrad
    for a, b in zip(got, want):
        assert bits_equal(a, b)
