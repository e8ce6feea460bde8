"""GroupedLinear: bitwise equal to independent per-expert TrainingLinears, zero-token experts,
all-zero gradients, token-count validation."""

from __future__ import annotations

import pytest
import torch

from qtensor import HybridTensor, NVFP4Tensor
from qtensor.training import GroupedLinear, NVFP4TrainingRecipe, TrainingLinear

E, K, N = 4, 64, 64
SPLITS = [16, 0, 32, 16]  # expert 1 gets no token
RL_ROW = dict(rht=False, stochastic_rounding=False, weight_2d=False, row_scaled_activation=True)
RECIPES = {
    "rl_row": NVFP4TrainingRecipe(**RL_ROW),
    "rl_plain": NVFP4TrainingRecipe(**dict(RL_ROW, row_scaled_activation=False)),
    "rl_row_dgrad_mxfp8": NVFP4TrainingRecipe(dgrad_mxfp8=True, **RL_ROW),
    "rl_row_grad_4over6": NVFP4TrainingRecipe(fourover6_grad=True, fourover6_roles="all",
                                              **RL_ROW),
    "nvfp4_2d_rht": NVFP4TrainingRecipe(stochastic_rounding=False),
    "dequantized": NVFP4TrainingRecipe(backward_override="dequantized", **RL_ROW),
    "high_precision": NVFP4TrainingRecipe(backward_override="high_precision"),
}


def make(recipe, splits=SPLITS, seed=0):
    torch.manual_seed(seed)
    g = GroupedLinear(E, K, N, recipe=recipe)
    t = sum(splits)
    x = torch.randn(t, K) * 0.5
    x[2, 7] = 10.0  # an outlier token
    dy = torch.randn(t, N) * 1e-3
    return g, x, dy


def run_grouped(g, x, dy, splits=SPLITS):
    x = x.clone().requires_grad_()
    y = g(x, splits)
    y.backward(dy)
    return y.detach(), x.grad, g.weight.grad, g.bias.grad


@pytest.mark.parametrize("name", list(RECIPES), ids=list(RECIPES))
def test_grouped_equals_independent_linears_bitwise(name):
    recipe = RECIPES[name]
    g, x, dy = make(recipe)
    y, dx, dw, db = run_grouped(g, x, dy)
    start = 0
    for e, m in enumerate(SPLITS):
        if m == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
            assert torch.equal(db[e], torch.zeros_like(db[e]))
            continue
        lin = TrainingLinear(K, N, recipe=recipe)
        with torch.no_grad():
            lin.weight.copy_(g.weight[e])
            lin.bias.copy_(g.bias[e])
        xe = x[start:start + m].clone().requires_grad_()
        ye = lin(xe)
        ye.backward(dy[start:start + m])
        assert torch.equal(ye, y[start:start + m])
        assert torch.equal(xe.grad, dx[start:start + m])
        assert torch.equal(lin.weight.grad, dw[e]) and torch.equal(lin.bias.grad, db[e])
        start += m


def test_row_scaled_input_is_quantized_once_for_all_experts():
    # Slicing the all-token row-scaled operand equals quantizing each expert's tokens.
    x = torch.randn(64, K)
    x[5] *= 100
    whole = NVFP4Tensor.from_hp(x, row_scaled=True)
    part = NVFP4Tensor.from_hp(x[16:48], row_scaled=True)
    sliced = whole[16:48]
    for name in ("qdata", "scale", "amax"):
        assert torch.equal(getattr(sliced, name).view(torch.uint8) if name == "scale"
                           else getattr(sliced, name),
                           getattr(part, name).view(torch.uint8) if name == "scale"
                           else getattr(part, name))


@pytest.mark.parametrize("name", ["rl_row", "rl_row_dgrad_mxfp8", "nvfp4_2d_rht", "dequantized"])
@pytest.mark.parametrize("pattern", ["all_zero", "leading_rows", "zero_expert_grad",
                                     "zero_input_rows"])
def test_grouped_all_zero_gradient_patterns(name, pattern):
    g, x, dy = make(RECIPES[name])
    dy = dy.clone()
    zero_rows = []
    if pattern == "all_zero":
        dy.zero_()
        zero_rows = list(range(dy.shape[0]))
    elif pattern == "leading_rows":
        dy[:24] = 0
        zero_rows = list(range(24))
    elif pattern == "zero_expert_grad":
        dy[16:48] = 0  # expert 2 gets an all-zero grad_output
        zero_rows = list(range(16, 48))
    else:
        x = x.clone()
        x[16:32] = 0
    y, dx, dw, db = run_grouped(g, x, dy)
    for t in (y, dx, dw, db):
        assert torch.isfinite(t).all()
    if zero_rows:
        assert torch.equal(dx[zero_rows], torch.zeros_like(dx[zero_rows]))
    if pattern == "all_zero":
        assert torch.equal(dw, torch.zeros_like(dw))
    if pattern == "zero_expert_grad":
        assert torch.equal(dw[2], torch.zeros_like(dw[2]))
        assert not torch.equal(dw[0], torch.zeros_like(dw[0]))


def test_all_experts_empty_and_tensor_counts():
    g, _, _ = make(RECIPES["rl_row"])
    x = torch.zeros(0, K, requires_grad=True)
    y = g(x, torch.tensor([0, 0, 0, 0]))
    y.sum().backward()
    assert y.shape == (0, N) and x.grad.shape == (0, K)
    assert torch.equal(g.weight.grad, torch.zeros_like(g.weight))


def test_token_count_errors():
    g, x, _ = make(RECIPES["rl_row"])
    with pytest.raises(ValueError, match="summing to 64 tokens"):
        g(x, [16, 16, 16, 0, 16])
    with pytest.raises(ValueError, match="non-negative counts"):
        g(x, [80, -16, 0, 0])
    with pytest.raises(ValueError, match="pad the batch \\(per expert"):
        g(x, [8, 8, 32, 16])  # 8 tokens: NVFP4 columnwise blocks need 16
    hp = GroupedLinear(E, K, N, recipe=RECIPES["high_precision"])
    y = hp(x, [8, 8, 32, 16])  # no quantized backward: any counts
    y.sum().backward()
    assert torch.isfinite(hp.weight.grad).all()


def test_stochastic_rounding_expert_e_rounds_with_seed_plus_e():
    # One step advances the grouped module's seeds by E; expert e rounds with seed + e, so it is
    # bitwise a TrainingLinear whose state starts e seeds later.
    recipe = NVFP4TrainingRecipe()  # 2D weights, RHT, stochastic rounding
    g, x, dy = make(recipe)
    start_state = g.sr_state.clone()
    y, dx, dw, db = run_grouped(g, x, dy)
    assert torch.equal(g.sr_state[:, 0], start_state[:, 0] + E)
    start = 0
    for e, m in enumerate(SPLITS):
        if m == 0:
            continue
        lin = TrainingLinear(K, N, recipe=recipe)
        with torch.no_grad():
            lin.weight.copy_(g.weight[e])
            lin.bias.copy_(g.bias[e])
            lin.sr_state[:, 0] += e
        xe = x[start:start + m].clone().requires_grad_()
        lin(xe).backward(dy[start:start + m])
        assert torch.equal(xe.grad, dx[start:start + m]) and torch.equal(lin.weight.grad, dw[e])
        start += m


def test_stochastic_rounding_is_deterministic_per_module():
    recipe = NVFP4TrainingRecipe()  # stochastic rounding on
    grads = []
    for _ in range(2):
        g, x, dy = make(recipe)
        grads.append(run_grouped(g, x, dy)[2])
    assert torch.equal(grads[0], grads[1])
    g, x, dy = make(NVFP4TrainingRecipe(seed=1))
    assert not torch.equal(run_grouped(g, x, dy)[2], grads[0])


def test_grouped_products_take_the_stacked_weight_and_one_call(monkeypatch):
    # fprop and dgrad are one grouped product each for all experts, on the weight stacked once
    # per rebuild; each expert's own operand is a view of the stack's bytes.
    from qtensor.training import grouped as grouped_module

    calls = []
    real = grouped_module.grouped_mm
    monkeypatch.setattr(grouped_module, "grouped_mm",
                        lambda *a, **k: calls.append(a[2].tolist()) or real(*a, **k))
    g, x, dy = make(RECIPES["nvfp4_2d_rht"])
    run_grouped(g, x, dy)
    assert calls == [[16, 16, 48, 64]] * 2  # fprop, dgrad
    stack = g.weight_cache.operand
    for e in range(E):
        op = stack.op(e)
        assert op.rowwise.qdata.data_ptr() == stack.rows.qdata[e].data_ptr()
        assert op.columnwise.qdata.data_ptr() == stack.cols.qdata[e].data_ptr()
        assert torch.equal(op.rowwise.amax.expand(N), stack.rows.amax[e])


WEIGHT_RECIPES = {
    "rl_row": RECIPES["rl_row"],
    "rl_row_dgrad_mxfp8": RECIPES["rl_row_dgrad_mxfp8"],
    "weights_4over6": NVFP4TrainingRecipe(fourover6_roles="weights", **RL_ROW),
    "dequantized": RECIPES["dequantized"],
}


def _same_bytes(a, b) -> bool:
    if isinstance(a, HybridTensor):
        return type(b) is HybridTensor and a.columnwise_source == b.columnwise_source and \
            _same_bytes(a.rowwise, b.rowwise) and _same_bytes(a.columnwise, b.columnwise)
    # Bit patterns: a NaN amax equals itself.
    return repr(a) == repr(b) and all(
        torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).view(torch.uint8))
        if getattr(a, n).dtype.itemsize == 1 else
        torch.equal(getattr(a, n).view(torch.int32), getattr(b, n).view(torch.int32))
        for n in a.tensor_data_names)


def _experts_weights_check(name, dtype, device):
    # One pass per usage over [E, N, K] gives every expert the bytes, spec and 0-d amax of its
    # own quantize_weight: outliers, an all-zero expert (amax 0), tiny and huge experts.
    from qtensor.training.experts import quantize_experts
    from qtensor.training.linear import quantize_weight

    specs = WEIGHT_RECIPES[name].operand_specs()
    torch.manual_seed(1)
    w = torch.randn(5, 64, 96)
    w[0, 3, 7] = 40.0
    w[1] = 0.0
    w[2] *= 1e-30
    w[3] *= 1e30
    w = w.to(device, dtype)
    stack = quantize_experts(w, specs.weight)
    assert stack is not None
    for e in range(5):
        assert _same_bytes(stack.op(e), quantize_weight(w[e], specs)), f"expert {e}"


@pytest.mark.parametrize("name", list(WEIGHT_RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_weights_quantized_at_once_are_each_experts_own(name, dtype):
    _experts_weights_check(name, dtype, "cpu")


@pytest.mark.parametrize("name", ["rl_row", "rl_row_dgrad_mxfp8"])
def test_experts_weights_at_once_on_the_reference_quantizer(name):
    # The reference backend (no extension, or forced) reduces each row's amax in Python.
    from qtensor import backends
    from qtensor.backends import BackendPolicy

    try:
        backends.set_policy(BackendPolicy(force_quant_reference=True))
        _experts_weights_check(name, torch.bfloat16, "cpu")
    finally:
        backends.set_policy(None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(WEIGHT_RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_experts_weights_quantized_at_once_are_each_experts_own(name, dtype):
    _experts_weights_check(name, dtype, "cuda")


def test_two_d_weights_are_quantized_per_expert():
    from qtensor.training.experts import quantize_experts

    assert quantize_experts(torch.randn(2, 32, 32), NVFP4TrainingRecipe().operand_specs().weight) \
        is None


def test_stacked_operands_refuse_mixed_layouts():
    from qtensor.training.experts import ExpertStack, cat_rows
    from qtensor.training.roles import RoleSpec

    a = NVFP4Tensor.from_hp(torch.randn(16, K))
    b = NVFP4Tensor.from_hp(torch.randn(16, K), fourover6="mae")
    with pytest.raises(ValueError, match="different layouts"):
        cat_rows([a, b], a.spec)
    with pytest.raises(ValueError, match="at least one"):
        cat_rows([], a.spec)
    rht = NVFP4Tensor.from_hp(torch.randn(K, 16), columnwise=True, rht=True)
    row = NVFP4Tensor.from_hp(torch.randn(16, K))
    hybrid = HybridTensor(row.shape, row.dtype, row.device, rowwise=row, columnwise=rht,
                          columnwise_source="original")
    with pytest.raises(ValueError, match="RHT"):
        ExpertStack.build([hybrid], RoleSpec(row.spec, rht.spec))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["rl_row", "rl_plain", "rl_row_dgrad_mxfp8", "nvfp4_2d_rht"])
def test_cuda_grouped_matches_independent_linears(name):
    # On the GPU the grouped kernels sum each output in their own order: every expert's
    # output, dX and dW (one product grouped along the tokens) equal an independent
    # TrainingLinear's up to the fp32 accumulation order (the bf16 rounding of it).
    recipe = RECIPES[name]
    splits = [128, 0, 256, 64, 0, 32, 160, 128]
    torch.manual_seed(0)
    e_, k, n = len(splits), 256, 512
    g = GroupedLinear(e_, k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    x = (torch.randn(sum(splits), k, device="cuda") * 0.5).bfloat16().requires_grad_()
    dy = (torch.randn(sum(splits), n, device="cuda") * 1e-3).bfloat16()
    y = g(x, splits)
    y.backward(dy)
    start = 0
    for e, m in enumerate(splits):
        if m == 0:
            assert not g.weight.grad[e].any()
            continue
        lin = TrainingLinear(k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(g.weight[e])
            lin.bias.copy_(g.bias[e])
        xe = x.detach()[start:start + m].clone().requires_grad_()
        ye = lin(xe)
        ye.backward(dy[start:start + m])
        for got, want in ((y[start:start + m], ye), (x.grad[start:start + m], xe.grad),
                          (g.weight.grad[e], lin.weight.grad)):
            got, want = got.float(), want.float()
            tol = 2.0**-7 * want.abs() + 1e-6 * want.abs().max()
            assert ((got - want).abs() <= tol).all(), f"expert {e}"
        start += m


@pytest.mark.parametrize("name", ["rl_row", "nvfp4_2d_rht"])
def test_graph_safe_cache_rewrites_the_stacks_in_place(name):
    # The gated update writes the stacks' own buffers, and each expert's operand (a view of
    # them) follows: True keeps the first micro-batch's bytes, False takes the new weight's.
    from qtensor.training.weight_cache import leaves

    g, x, _ = make(RECIPES[name])
    g.skip_weight_update = torch.tensor(False)
    g(x, SPLITS)
    stack = g.weight_cache.operand
    ptrs = [t.data_ptr() for t in leaves(stack)]
    first = [t.clone() for t in leaves(stack)]
    view_before = stack.op(2).rowwise.qdata.clone()
    with torch.no_grad():
        g.weight.mul_(-2.0)
    g.skip_weight_update.fill_(True)
    g(x, SPLITS)
    assert g.weight_cache.operand is stack
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(leaves(stack), first))
    g.skip_weight_update.fill_(False)
    g(x, SPLITS)
    assert [t.data_ptr() for t in leaves(stack)] == ptrs
    fresh = g._build_weight(g.weight.detach())
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(leaves(stack), leaves(fresh)))
    assert not torch.equal(stack.op(2).rowwise.qdata, view_before)
    assert torch.equal(stack.op(2).rowwise.qdata, fresh.op(2).rowwise.qdata)


ROW_SPECS = {"nvfp4": {}, "4over6": dict(fourover6="mae"), "bound256": dict(e4m3_bound=256)}




def _experts_tokens(device, seed):
    """(splits, x [T, 64] bf16, offs): six experts, two of them empty; an outlier in expert 3, an
    expert of tiny values (4) and a NaN in expert 5."""
    splits = [32, 0, 16, 48, 0, 16]
    torch.manual_seed(seed)
    x = torch.randn(sum(splits), 64).bfloat16()
    x[40, 3] = 300.0
    x[48:96] *= 1e-20
    x[100, 5] = float("nan")
    offs = torch.tensor(splits).cumsum(0).to(device=device, dtype=torch.int32)
    return splits, x.to(device), offs


def _experts_rows_check(spec_kw, device):
    # One pass over all tokens with each expert's amax: every expert's rows are bitwise its own
    # cast (bytes, spec, 0-d amax), zero-token experts included; a NaN poisons only its expert.
    from qtensor.formats.nvfp4 import NVFP4Spec
    from qtensor.training.experts import cast_expert_rows

    spec = NVFP4Spec(**spec_kw)
    splits, x, offs = _experts_tokens(device, seed=2)
    whole, parts = cast_expert_rows(x, splits, offs, spec)
    assert whole.row_scaled and whole.shape == x.shape
    start = 0
    for e, m in enumerate(splits):
        if m == 0:
            assert parts[e] is None
            continue
        own = NVFP4Tensor.from_spec(x[start:start + m], spec, check_finite=False)
        assert _same_bytes(parts[e], own), f"expert {e}"
        assert torch.equal(whole.qdata[start:start + m], own.qdata)
        start += m
    assert torch.isnan(parts[5].amax) and torch.isfinite(parts[3].amax)


COL_SPECS = {"plain": {"columnwise": True}, "row_scaled": {"columnwise": True, "row_scaled": True},
             "bound256": {"columnwise": True, "e4m3_bound": 256}}
# (which usage, spec): the experts' casts at once, rowwise (cast_expert_rows) and columnwise
# (cast_expert_cols)
AT_ONCE = [("rows", kw) for kw in ROW_SPECS.values()] + [("cols", kw) for kw in COL_SPECS.values()]
AT_ONCE_IDS = [f"rows-{k}" for k in ROW_SPECS] + [f"cols-{k}" for k in COL_SPECS]


@pytest.mark.parametrize("usage,spec_kw", AT_ONCE, ids=AT_ONCE_IDS)
def test_experts_cast_at_once_are_each_experts_own(usage, spec_kw):
    (_experts_rows_check if usage == "rows" else _experts_cols_check)(spec_kw, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("usage,spec_kw", AT_ONCE, ids=AT_ONCE_IDS)
def test_cuda_experts_cast_at_once_are_each_experts_own(usage, spec_kw):
    (_experts_rows_check if usage == "rows" else _experts_cols_check)(spec_kw, "cuda")


def _experts_cols_check(spec_kw, device):
    # One columnwise pass over all tokens with a per-block amax: every expert's columns (codes,
    # scales) and amax are bitwise its own columnwise cast's; an outlier, a tiny expert and a
    # NaN stay in their experts.
    from qtensor.formats.nvfp4 import NVFP4Spec
    from qtensor.training.experts import cast_expert_cols

    spec = NVFP4Spec(**spec_kw)
    splits, x, offs = _experts_tokens(device, seed=3)
    whole = cast_expert_cols(x, offs, spec)
    assert whole.data.shape == (64, sum(splits) // 2) and whole.bound == spec.e4m3_bound
    assert whole.amax.shape == ((len(splits), 64) if spec.row_scaled else (len(splits),))
    start = 0
    for e, m in enumerate(splits):
        if m == 0:
            assert not whole.amax[e].any()
            continue
        own = NVFP4Tensor.from_spec(x[start:start + m], spec, check_finite=False)
        assert torch.equal(whole.data[:, start // 2:(start + m) // 2], own.qdata), f"expert {e}"
        assert torch.equal(whole.scale[:, start // 16:(start + m) // 16].view(torch.uint8),
                           own.scale.view(torch.uint8)), f"expert {e}"
        assert torch.equal(whole.amax[e], own.amax) or (
            torch.isnan(whole.amax[e]).any() and torch.isnan(own.amax).any()), f"expert {e}"
        start += m
