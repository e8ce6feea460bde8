"""TrainingLinear: each GEMM against fp32 GEMMs on the dequantized operands the seeds prescribe.

The references build every operand here, explicitly, with the tensor classes' from_hp and
dequantize() (not through the recipe), and multiply in fp32. Negative controls show each
reference would catch the wrong operand. Compute dtype fp32 makes the emulated GEMM equal to
the reference up to fp32 rounding (relative error < 1e-5); the controls differ by > 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from qtensor import HybridTensor, MXFP8Tensor, NVFP4Tensor, quantized_mm
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed
from qtensor.training import NVFP4TrainingRecipe, SRSeeds, TrainingLinear

M, K, N = 64, 128, 64  # tokens, in_features, out_features
F32 = torch.float32
RL = dict(rht=False, stochastic_rounding=False, weight_2d=False)
RL_ROW = dict(RL, row_scaled_activation=True)


def make(recipe, dtype=F32, bias=True, seed=0):
    torch.manual_seed(seed)
    m = TrainingLinear(K, N, bias=bias, recipe=recipe, dtype=dtype)
    x = torch.randn(M, K, dtype=dtype) * 0.5
    x[3, 5] = 8.0  # one outlier token, so row scaling matters
    g = torch.randn(M, N, dtype=dtype) * 1e-3
    return m, x, g


def run(m, x, g):
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    return y.detach(), x.grad, m.weight.grad.clone()


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def deq(t):
    return t.dequantize(F32)


def slot_generator(recipe, usage, step=0):
    """The (seed, offset) of the module's step `step` in a slot: each step moves the seed on by
    one (docs/training.md, "Randomness")."""
    return SRSeed(SRSeeds(recipe.seed, 0).seed_for(f"grad_output.{usage}") + step, 0)


# ---- independent references ----------------------------------------------------------------


def test_nvfp4_default_recipe_gemms():
    r = NVFP4TrainingRecipe()  # 2D weights, RHT on wgrad operands, stochastic rounding
    m, x, g = make(r)
    y, dx, dw = run(m, x, g)
    w, b = m.weight.detach(), m.bias.detach()
    X, W = NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(w, block_2d=True)
    assert rel(y, deq(X) @ deq(W).T + b) < 1e-5
    dY = NVFP4Tensor.from_hp(g, stochastic_rounding=True, generator=slot_generator(r, "rowwise"))
    Wc = NVFP4Tensor.from_hp(w, block_2d=True, columnwise=True)
    assert rel(dx, deq(dY) @ deq(Wc)) < 1e-5
    dYc = NVFP4Tensor.from_hp(g, columnwise=True, rht=True, stochastic_rounding=True,
                              generator=slot_generator(r, "columnwise"))
    Xc = NVFP4Tensor.from_hp(x, columnwise=True, rht=True)
    # RHT's M is orthogonal (M M^T = I), so the transformed operands' product is dW.
    assert rel(dw, deq(dYc).T @ deq(Xc)) < 1e-5
    # Negative controls: the same GEMMs without SR / without RHT are measurably different.
    assert rel(dx, deq(NVFP4Tensor.from_hp(g)) @ deq(Wc)) > 1e-3
    no_rht = (deq(NVFP4Tensor.from_hp(g, columnwise=True)).T
              @ deq(NVFP4Tensor.from_hp(x, columnwise=True)))
    assert rel(dw, no_rht) > 1e-3


@pytest.mark.parametrize("row_scaled", [False, True])
def test_dgrad_mxfp8_gemms_and_negative_controls(row_scaled):
    r = NVFP4TrainingRecipe(dgrad_mxfp8=True, **(RL_ROW if row_scaled else RL))
    m, x, g = make(r)
    y, dx, dw = run(m, x, g)
    w, b = m.weight.detach(), m.bias.detach()
    X = NVFP4Tensor.from_hp(x, row_scaled=row_scaled)
    W = NVFP4Tensor.from_hp(w)
    assert rel(y, deq(X) @ deq(W).T + b) < 1e-5
    # dgrad: MXFP8 grad_output x MXFP8 of the dequantized NVFP4 weight.
    W_mx = MXFP8Tensor.from_hp(W.dequantize(w.dtype), columnwise=True)
    dY_mx = MXFP8Tensor.from_hp(g)
    assert rel(dx, deq(dY_mx) @ deq(W_mx)) < 1e-5
    # wgrad: NVFP4 columnwise grad_output x NVFP4 columnwise input (per-column amax if row-scaled).
    dYc = NVFP4Tensor.from_hp(g, columnwise=True)
    Xc = NVFP4Tensor.from_hp(x, columnwise=True, row_scaled=row_scaled)
    assert rel(dw, deq(dYc).T @ deq(Xc)) < 1e-5
    # Negative controls: NVFP4 dgrad, and MXFP8 of the original weight.
    nv_dgrad = deq(NVFP4Tensor.from_hp(g)) @ deq(NVFP4Tensor.from_hp(w, columnwise=True))
    assert rel(dx, nv_dgrad) > 1e-2
    W_orig = MXFP8Tensor.from_hp(w, columnwise=True)
    assert not torch.equal(W_orig.qdata.view(torch.uint8), W_mx.qdata.view(torch.uint8))
    assert rel(dx, deq(dY_mx) @ deq(W_orig)) > 1e-3


@pytest.mark.parametrize("scope, bound", [("all", 256), ("none", 448)])
def test_gradient_fourover6_gemms(scope, bound):
    r = NVFP4TrainingRecipe(fourover6_grad=True, fourover6_e4m3_256_roles=scope, **RL)
    m, x, g = make(r)
    _, dx, dw = run(m, x, g)
    w = m.weight.detach()
    Wc, Xc = NVFP4Tensor.from_hp(w, columnwise=True), NVFP4Tensor.from_hp(x, columnwise=True)
    dY = NVFP4Tensor.from_hp(g, fourover6="mae", e4m3_bound=bound)
    dYc = NVFP4Tensor.from_hp(g, fourover6="mae", e4m3_bound=bound, columnwise=True)
    assert rel(dx, deq(dY) @ deq(Wc)) < 1e-5
    assert rel(dw, deq(dYc).T @ deq(Xc)) < 1e-5
    # Negative control: standard NVFP4 gradients.
    assert rel(dx, deq(NVFP4Tensor.from_hp(g)) @ deq(Wc)) > 1e-3
    assert rel(dw, deq(NVFP4Tensor.from_hp(g, columnwise=True)).T @ deq(Xc)) > 1e-3


def test_forward_fourover6_scopes():
    r = NVFP4TrainingRecipe(fourover6_roles="all", fourover6_error="mse", **RL)
    m, x, g = make(r)
    y, _, _ = run(m, x, g)
    X = NVFP4Tensor.from_hp(x, fourover6="mse", e4m3_bound=256)
    W = NVFP4Tensor.from_hp(m.weight.detach(), fourover6="mse", e4m3_bound=256)
    ref = deq(X) @ deq(W).T + m.bias.detach()
    assert rel(y, ref) < 1e-5
    plain = deq(NVFP4Tensor.from_hp(x)) @ deq(NVFP4Tensor.from_hp(m.weight.detach())).T
    assert rel(y, plain + m.bias.detach()) > 1e-3


@pytest.mark.parametrize("override", ["dequantized", "high_precision"])
def test_backward_overrides(override):
    r = NVFP4TrainingRecipe(backward_override=override, **RL_ROW)
    m, x, g = make(r)
    _, dx, dw = run(m, x, g)
    w = m.weight.detach()
    if override == "dequantized":
        x_b, w_b = deq(NVFP4Tensor.from_hp(x, row_scaled=True)), deq(NVFP4Tensor.from_hp(w))
    else:
        x_b, w_b = x, w
    assert rel(dx, g @ w_b) < 1e-6
    assert rel(dw, g.T @ x_b) < 1e-6
    other = x if override == "dequantized" else deq(NVFP4Tensor.from_hp(x, row_scaled=True))
    assert rel(dw, g.T @ other) > 1e-3


# ---- dispatch parity and numerics ------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 2])
def test_dgrad_mxfp8_equals_explicit_hybrid_tensors_bitwise(step):
    r = NVFP4TrainingRecipe(dgrad_mxfp8=True)  # with RHT and stochastic rounding
    m, x, g = make(r)
    for _ in range(step):  # earlier steps: each advances the stochastic-rounding seeds
        run(m, x, g)
        m.weight.grad = m.bias.grad = None
    y, dx, dw = run(m, x, g)
    w, b = m.weight.detach(), m.bias.detach()
    x_h = HybridTensor.from_hp(x, rowwise=NVFP4Spec(),
                               columnwise=NVFP4Spec(rht=True, columnwise=True))
    w_h = HybridTensor.from_hp(w, rowwise=NVFP4Spec(block_2d=True), columnwise=MXFP8Spec(),
                               columnwise_source="rowwise_dequantized")
    dy_h = HybridTensor.from_hp(g, rowwise=MXFP8Spec(),
                                columnwise=NVFP4Spec(rht=True, stochastic_rounding=True,
                                                      columnwise=True),
                                generator=slot_generator(r, "columnwise", step))
    assert torch.equal(y, quantized_mm(x_h, w_h.t(), b, out_dtype=F32))
    assert torch.equal(dx, quantized_mm(dy_h, w_h, out_dtype=F32))
    assert torch.equal(dw, quantized_mm(dy_h.t(), x_h, out_dtype=F32))


@pytest.mark.parametrize("kw", [{}, RL_ROW], ids=["default", "rl_row_scaled"])
def test_dgrad_mxfp8_keeps_forward_and_wgrad_bitwise(kw):
    y_nv, dx_nv, dw_nv = run(*make(NVFP4TrainingRecipe(**kw)))
    y_mx, dx_mx, dw_mx = run(*make(NVFP4TrainingRecipe(dgrad_mxfp8=True, **kw)))
    assert torch.equal(y_nv, y_mx) and torch.equal(dw_nv, dw_mx)
    assert not torch.equal(dx_nv, dx_mx)


@pytest.mark.parametrize("kw", [RL_ROW, {}], ids=["rl_row_scaled", "default"])
def test_dgrad_mxfp8_halves_the_dgrad_error(kw):
    _, dx_ref, _ = run(*make(NVFP4TrainingRecipe(backward_override="dequantized", **kw)))
    _, dx_nv, _ = run(*make(NVFP4TrainingRecipe(**kw)))
    _, dx_mx, _ = run(*make(NVFP4TrainingRecipe(dgrad_mxfp8=True, **kw)))
    err_nv, err_mx = rel(dx_nv, dx_ref), rel(dx_mx, dx_ref)
    assert err_mx < 0.5 * err_nv, (err_mx, err_nv)


# ---- all-zero gradients, as RL losses make them ----------------------------------------------

RECIPES = {
    "nvfp4": NVFP4TrainingRecipe(),
    "dgrad_mxfp8": NVFP4TrainingRecipe(dgrad_mxfp8=True),
    "rl_row_dgrad_mxfp8": NVFP4TrainingRecipe(dgrad_mxfp8=True, **RL_ROW),
    "grad_4over6": NVFP4TrainingRecipe(fourover6_grad=True, fourover6_roles="weights", **RL),
    "dequantized": NVFP4TrainingRecipe(backward_override="dequantized", **RL_ROW),
}


def zero_pattern(name, g):
    g = g.clone()
    zero_rows = []
    if name == "leading_rows":
        g[:20] = 0
        zero_rows = list(range(20))
    elif name == "sparse_rows":
        keep = [3, 40]
        zero_rows = [i for i in range(g.shape[0]) if i not in keep]
        g[zero_rows] = 0
    elif name == "zero_blocks":
        g[:, 16:32] = 0  # a 16-element block of every row
        g[32:48, :] = 0  # a 16-element block of every column
        zero_rows = list(range(32, 48))
    elif name == "all_zero":
        g.zero_()
        zero_rows = list(range(g.shape[0]))
    return g, zero_rows


@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
@pytest.mark.parametrize("pattern", ["leading_rows", "sparse_rows", "zero_blocks", "all_zero",
                                     "zero_input_rows"])
def test_all_zero_gradient_patterns(recipe, pattern):
    m, x, g = make(RECIPES[recipe])
    g, zero_rows = zero_pattern(pattern, g)
    if pattern == "zero_input_rows":
        x = x.clone()
        x[:16] = 0
    y, dx, dw = run(m, x, g)
    for t in (y, dx, dw, m.bias.grad):
        assert torch.isfinite(t).all()
    if zero_rows:
        assert torch.equal(dx[zero_rows], torch.zeros_like(dx[zero_rows]))
    if pattern == "all_zero":
        assert torch.equal(dw, torch.zeros_like(dw))
        assert torch.equal(m.bias.grad, torch.zeros_like(m.bias.grad))
    if pattern == "zero_input_rows":
        assert torch.equal(y[:16], m.bias.detach().expand(16, N))


# ---- dtypes, autocast, bias, shapes ------------------------------------------------------------


def test_bf16_master_weights_and_no_bias():
    r = NVFP4TrainingRecipe(**RL)
    m, x, g = make(r, dtype=torch.bfloat16, bias=False)
    y, dx, dw = run(m, x, g)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16 and m.bias is None
    X, W = NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(m.weight.detach())
    assert rel(y, deq(X) @ deq(W).T) < 4e-3  # bf16 output rounding
    dY, Wc = NVFP4Tensor.from_hp(g), NVFP4Tensor.from_hp(m.weight.detach(), columnwise=True)
    assert rel(dx, deq(dY) @ deq(Wc)) < 4e-3


def test_autocast_bf16_with_fp32_master_weights():
    r = NVFP4TrainingRecipe(**RL)
    m, x, g = make(r)
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(xg)
    y.backward(g.bfloat16())
    assert y.dtype == torch.bfloat16
    assert xg.grad.dtype == F32 and m.weight.grad.dtype == F32 and m.bias.grad.dtype == F32
    # The input is quantized from its bf16 cast, the weight from the fp32 master.
    X, W = NVFP4Tensor.from_hp(x.bfloat16()), NVFP4Tensor.from_hp(m.weight.detach())
    assert rel(y, deq(X) @ deq(W).T + m.bias.detach()) < 4e-3
    dYc = NVFP4Tensor.from_hp(g.bfloat16(), columnwise=True)
    Xc = NVFP4Tensor.from_hp(x.bfloat16(), columnwise=True)
    assert rel(m.weight.grad, deq(dYc).T @ deq(Xc)) < 1e-5  # wgrad straight from fp32


def test_3d_input_and_shape_errors():
    m = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RL))
    x = torch.randn(2, 32, K, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (2, 32, N) and x.grad.shape == x.shape
    with pytest.raises(ValueError, match="token counts divisible by 16"):
        m(torch.randn(24, K))
    with torch.no_grad():  # no backward: only the rowwise (fprop) operands, any token count
        x24 = torch.randn(24, K)
        ref = NVFP4Tensor.from_hp(x24).dequantize(F32) @ deq(NVFP4Tensor.from_hp(m.weight)).T
        assert rel(m(x24), ref + m.bias) < 1e-5
    with pytest.raises(ValueError, match="in_features divisible by 16"):
        TrainingLinear(40, N, recipe=NVFP4TrainingRecipe(**RL))
    with pytest.raises(ValueError, match="divisible by 32"):
        TrainingLinear(K, 48, recipe=NVFP4TrainingRecipe(dgrad_mxfp8=True))
    # The high-precision backward needs no token alignment.
    hp = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(backward_override="high_precision"))
    xs = torch.randn(24, K, requires_grad=True)
    hp(xs).sum().backward()
    assert torch.isfinite(xs.grad).all()


# ---- one amax for both usages ----------------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw, shared", [
    ({}, {"weight"}),  # the default: RHT on the wgrad operands, 2D weights
    (dict(fourover6_roles="all", rht=False), {"input", "weight", "grad_output"}),
    (RL, {"input", "weight", "grad_output"}),
    (dict(RL, row_scaled_activation=True), {"weight", "grad_output"}),
])
def test_roles_share_an_amax_only_where_it_is_the_same(kw, shared, device):
    """A role whose columnwise cast takes the rowwise side's amax (no RHT, no row scaling) has
    both sides byte-equal to casts that each compute their own; the other roles compute two."""
    from qtensor.tensors import quantize_spec
    from qtensor.training.roles import quantize_role, sr_for_role

    specs = NVFP4TrainingRecipe(**kw).operand_specs()
    states = SRSeeds(7, 0).initial_state(device)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(64, 128, generator=gen, device=device).to(torch.bfloat16)
    x[3, 5] = 40.0  # the amax sits in one block of each direction
    for name in ("input", "weight", "grad_output"):
        role = specs.role(name)
        sr = sr_for_role(name, role, states)
        op = quantize_role(x, role, name, sr)
        assert (op.columnwise.amax is op.rowwise.amax) == (name in shared), name
        for part, spec, state in ((op.rowwise, role.rowwise, sr[0]),
                                  (op.columnwise, role.columnwise, sr[1])):
            alone = quantize_spec(x, spec, generator=state, check_finite=False)
            for field in ("qdata", "scale", "amax"):
                a, b = getattr(part, field), getattr(alone, field)
                assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                   b.view(torch.uint8) if b.dtype.itemsize == 1 else b), \
                    (name, spec, field)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kw", [{}, dict(dgrad_mxfp8=True)])
def test_backward_in_the_calling_thread_gives_the_engines_gradients(kw):
    """docs/training.md, "The backward's thread": with autograd's multithreading off the backward
    runs in the calling thread, and the output and both gradients are the engine thread's, bit
    for bit (the default recipe's RHT, stochastic rounding and 2D weights included)."""
    results = []
    for threaded in (True, False):
        m, x, g = make(NVFP4TrainingRecipe(**kw), dtype=torch.bfloat16)
        m, x, g = m.cuda(), x.cuda(), g.cuda()
        with torch.autograd.set_multithreading_enabled(threaded):
            results.append(run(m, x, g))
    for engine, caller in zip(*results):
        assert caller is not None and torch.equal(engine, caller)
