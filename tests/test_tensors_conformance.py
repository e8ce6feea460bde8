"""Subclass conformance, the same checks for every tensor class and several option combinations:
flatten/unflatten, detach, clone, to, transpose, view/reshape, slice/select/split, copy_,
torch.save / torch.load(weights_only=True), and a loud error for every op not in a table."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from conftest import leaves

from qtensor import (HybridTensor, MXFP4Tensor, MXFP8Spec, MXFP8Tensor, NVFP4Spec, NVFP4Tensor,
                     QuantizedTensor)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# name -> (factory of a [.., 32, 64] tensor, its block along the last dim (rowwise) or dim -2)
CASES = {
    "nvfp4": lambda: NVFP4Tensor.from_hp(_x(32, 64)),
    "nvfp4_2d_4o6_b256": lambda: NVFP4Tensor.from_hp(
        _x(32, 64), block_2d=True, fourover6="mse", e4m3_bound=256),
    "nvfp4_rowscaled": lambda: NVFP4Tensor.from_hp(_x(32, 64), row_scaled=True),
    "nvfp4_col_rht": lambda: NVFP4Tensor.from_hp(_x(32, 64), columnwise=True, rht=True),
    "nvfp4_col_rowscaled": lambda: NVFP4Tensor.from_hp(
        _x(32, 64), columnwise=True, row_scaled=True),
    "nvfp4_3d_sr": lambda: NVFP4Tensor.from_hp(
        _x(2, 32, 64), stochastic_rounding=True, generator=torch.Generator().manual_seed(1)),
    "mxfp8": lambda: MXFP8Tensor.from_hp(_x(32, 64)),
    "mxfp8_floor_col": lambda: MXFP8Tensor.from_hp(_x(32, 64), scale_rule="floor", columnwise=True),
    "mxfp4": lambda: MXFP4Tensor.from_hp(_x(32, 64)),
    "mxfp4_col_3d": lambda: MXFP4Tensor.from_hp(_x(2, 32, 64), columnwise=True),
    "hybrid": lambda: HybridTensor.from_hp(
        _x(32, 64), rowwise=NVFP4Spec(), columnwise=MXFP8Spec(),
        columnwise_source="rowwise_dequantized"),
}


@pytest.fixture(params=sorted(CASES))
def qt(request) -> QuantizedTensor:
    return CASES[request.param]()


def attrs(t) -> tuple:
    own = tuple(getattr(t, n) for n in t.tensor_attribute_names)
    nested = tuple(attrs(getattr(t, n)) for n in t.tensor_data_names
                   if isinstance(getattr(t, n), QuantizedTensor))
    return own + nested


def assert_same(a, b) -> None:
    """Same class, shape, dtype, metadata and bytes."""
    assert type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype
    assert attrs(a) == attrs(b)
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y)


def last_two_transposed(t):
    return t.transpose(-1, -2)


# ---- structure -----------------------------------------------------------------------------------


def test_flatten_unflatten_round_trip(qt):
    names, ctx = qt.__tensor_flatten__()
    assert set(names) <= set(qt.tensor_data_names)
    inner = {n: getattr(qt, n) for n in names}
    back = type(qt).__tensor_unflatten__(inner, ctx, qt.shape, qt.stride())
    assert_same(back, qt)
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_flatten_is_computed_once_and_never_pickled(qt):
    """A compiled function's guards flatten every quantized input on every call, so the
    flatten is computed once per tensor; the cache is not part of the tensor's state, so a
    pickle does not depend on whether the tensor was flattened before."""
    first = io.BytesIO()
    torch.save(qt, first)
    names, ctx = qt.__tensor_flatten__()
    names.append("not_a_field")  # the caller owns the list it gets
    again, ctx_again = qt.__tensor_flatten__()
    assert "not_a_field" not in again and ctx_again is ctx
    assert ctx[:3] == (tuple(qt.shape), qt.dtype,
                       tuple(getattr(qt, n) for n in qt.tensor_attribute_names))
    second = io.BytesIO()
    torch.save(qt, second)
    assert first.getvalue() == second.getvalue()
    first.seek(0)
    assert_same(torch.load(first, weights_only=False), qt)


def test_metadata_guard_tells_the_metadata_apart(qt, monkeypatch):
    """torch.compile's guard on a quantized input compares flatten contexts through the class's
    __metadata_guard__: a copy matches, another outer dtype or shape does not, and a compiled
    function runs the guard on each call and recompiles for another dtype only."""
    import copy

    from torch._dynamo.testing import CompileCounter

    cls = type(qt)
    guard, calls = cls.__metadata_guard__.__func__, []
    monkeypatch.setattr(cls, "__metadata_guard__",
                        classmethod(lambda c, a, b: calls.append(c) or guard(c, a, b)))
    _, ctx = qt.__tensor_flatten__()
    other_dtype = qt.replace(dtype=torch.float16)
    other_shape = qt.replace(shape=torch.Size([*qt.shape[:-1], qt.shape[-1] + 1]))
    assert cls.__metadata_guard__(copy.deepcopy(ctx), qt.__tensor_flatten__()[1])
    assert cls.__metadata_guard__(ctx, copy.deepcopy(qt).__tensor_flatten__()[1])
    for other in (other_dtype, other_shape):
        assert not cls.__metadata_guard__(ctx, other.__tensor_flatten__()[1])
    counter = CompileCounter()
    fn = torch.compile(lambda t: t.dequantize(), backend=counter, fullgraph=True)
    torch._dynamo.reset()
    fn(qt)
    calls.clear()
    fn(copy.deepcopy(qt))
    assert counter.frame_count == 1 and calls
    fn(other_dtype)
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_outer_dtype_and_dequantize(qt):
    assert qt.dtype == torch.bfloat16 and not qt.requires_grad
    assert qt.dequantize().dtype == torch.bfloat16
    assert qt.dequantize(torch.float16).dtype == torch.float16
    assert torch.equal(qt.dequantize(torch.float32).bfloat16(), qt.dequantize())


def test_detach_and_clone(qt):
    d = qt.detach()
    assert_same(d, qt)
    c = qt.clone()
    assert_same(c, qt)
    for orig, copy in zip(leaves(qt), leaves(c)):
        assert orig.data_ptr() != copy.data_ptr()  # clone owns its bytes


def test_to_dtype_sets_the_output_dtype_only(qt):
    f32 = qt.to(torch.float32)
    assert type(f32) is type(qt) and f32.dtype == torch.float32
    if isinstance(qt, HybridTensor):
        assert f32.rowwise.dtype == f32.columnwise.dtype == torch.float32
    assert f32.dequantize().dtype == torch.float32
    for a, b in zip(leaves(qt), leaves(f32)):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
    assert torch.equal(f32.dequantize(), qt.dequantize(torch.float32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16; got torch.int8"):
        qt.to(torch.int8)


def test_to_device(qt):
    moved = qt.to("cpu")
    assert_same(moved, qt)
    moved = qt.to(device="cpu", dtype=torch.float16)
    assert moved.dtype == torch.float16 and moved.device.type == "cpu"


def test_transpose_flips_axis_and_back(qt):
    t = last_two_transposed(qt)
    assert t.shape == (*qt.shape[:-2], qt.shape[-1], qt.shape[-2])
    if isinstance(qt, HybridTensor):  # the transpose's rowwise side is the columnwise side
        assert_same(t.rowwise, qt.columnwise.t())
        assert torch.equal(t.dequantize(), qt.columnwise.dequantize().t())
    else:
        assert torch.equal(t.dequantize(), qt.dequantize().transpose(-1, -2))
    if hasattr(qt, "axis"):
        assert t.axis != qt.axis
    back = last_two_transposed(t)
    assert_same(back, qt)
    if qt.dim() == 2:
        assert_same(qt.t().t(), qt)


def test_transpose_of_a_dim_with_itself_is_a_noop(qt):
    # (-1, d-1) names one dim twice: a new tensor with the same bytes, not a flip.
    d = qt.dim()
    same = qt.transpose(-1, d - 1)
    assert same is not qt and same.shape == qt.shape
    assert_same(same, qt)


def test_unknown_op_raises_naming_it(qt):
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor"):
        torch.add(qt, 1)
    with pytest.raises(NotImplementedError, match=r"aten\.exp\.default.*call \.dequantize\(\)"):
        torch.exp(qt)
    with pytest.raises(NotImplementedError, match=r"aten\.sum"):
        qt.sum()


# ---- serialization -------------------------------------------------------------------------------


def test_save_load_weights_only(qt):
    buf = io.BytesIO()
    torch.save({"t": qt}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["t"]
    assert_same(back, qt)
    assert torch.equal(back.dequantize(torch.float32), qt.dequantize(torch.float32))


@pytest.mark.parametrize("weight", ["nvfp4_dyn", "nvfp4_4o6", "mxfp8_dyn", "hybrid"])
def test_state_dict_round_trip_gives_bitwise_equal_outputs(weight):
    w = _x(32, 64, seed=2)
    make = {
        "nvfp4_dyn": lambda: NVFP4Tensor.from_hp(w).replace(act_spec=NVFP4Spec(row_scaled=True)),
        "nvfp4_4o6": lambda: NVFP4Tensor.from_hp(w, fourover6="mae", e4m3_bound=256, block_2d=True),
        "mxfp8_dyn": lambda: MXFP8Tensor.from_hp(w).replace(act_spec=MXFP8Spec(scale_rule="floor")),
        "hybrid": lambda: HybridTensor.from_hp(w, rowwise=NVFP4Spec(), columnwise=MXFP8Spec()),
    }[weight]
    m = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    m.weight = torch.nn.Parameter(make(), requires_grad=False)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    m2 = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    m2.load_state_dict(sd, assign=True)
    assert type(m2.weight) is type(m.weight)
    x = _x(3, 5, 64, seed=3)
    assert torch.equal(m2(x), m(x))
    assert torch.equal(F.linear(x, m2.weight), F.linear(x, m.weight))


# ---- views and slices (rowwise 1D-block tensors keep their last dim) ---------------------------


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_rowscaled", "nvfp4_3d_sr", "mxfp8"])
def test_view_and_reshape_keeping_the_last_dim(name):
    qt = CASES[name]()
    flat = qt.reshape(-1, 64)
    assert torch.equal(flat.dequantize(), qt.dequantize().reshape(-1, 64))
    three = flat.view(2, -1, 64)
    assert torch.equal(three.dequantize(), qt.dequantize().reshape(2, -1, 64))
    assert_same(three.reshape(qt.shape), qt)
    with pytest.raises(ValueError, match="keeps its last dim"):
        qt.reshape(-1, 32)


@pytest.mark.parametrize("name", ["nvfp4_col_rht", "nvfp4_2d_4o6_b256", "mxfp8_floor_col"])
def test_reshape_refused_where_blocks_would_break(name):
    qt = CASES[name]()
    with pytest.raises(ValueError, match="can be reshaped only when it is rowwise"):
        qt.reshape(64, 32)


@pytest.mark.parametrize("name,block", [("nvfp4", 16), ("nvfp4_rowscaled", 16), ("mxfp8", 32),
                                        ("nvfp4_3d_sr", 16)])
def test_slice_select_split_along_whole_blocks(name, block):
    qt = CASES[name]()
    full = qt.dequantize()
    part = qt[..., block : 3 * block] if block == 16 else qt[..., block:]
    want = full[..., block : 3 * block] if block == 16 else full[..., block:]
    assert torch.equal(part.dequantize(), want)
    rows = qt[..., 3:11, :]  # rows are not a block dim for 1x16 / 1x32 blocks
    assert torch.equal(rows.dequantize(), full[..., 3:11, :])
    sel = qt.select(-2, 5)
    assert torch.equal(sel.dequantize(), full.select(-2, 5))
    pieces = qt.split(block, dim=-1)
    assert len(pieces) == 64 // block
    assert torch.equal(torch.cat([p.dequantize() for p in pieces], -1), full)
    with pytest.raises(ValueError, match=f"only at multiples of {block}; got start 3"):
        qt[..., 3 : 3 + block]
    with pytest.raises(ValueError, match="cannot select along its block dim"):
        qt.select(-1, 0)
    with pytest.raises(ValueError, match="step 1 only"):
        qt[..., ::2]


@pytest.mark.parametrize("name,block", [("nvfp4_col_rowscaled", 16), ("mxfp8_floor_col", 32)])
def test_columnwise_slices_along_dim0_blocks(name, block):
    qt = CASES[name]()
    full = qt.dequantize()
    assert torch.equal(qt[block:].dequantize(), full[block:])
    assert torch.equal(qt[:, 5:9].dequantize(), full[:, 5:9])
    assert torch.equal(qt.select(1, 7).dequantize(), full[:, 7])
    with pytest.raises(ValueError, match=f"multiples of {block}"):
        qt[1:]


def test_2d_tiles_slice_rows_at_tile_boundaries_only():
    qt = CASES["nvfp4_2d_4o6_b256"]()
    assert torch.equal(qt[16:32].dequantize(), qt.dequantize()[16:32])
    with pytest.raises(ValueError, match="16x16 tiles slices rows only at multiples of 16"):
        qt[3:19]


def test_hybrid_slices_both_sides():
    h = CASES["hybrid"]()
    part = h[:, 32:]
    assert isinstance(part, HybridTensor) and part.shape == (32, 32)
    assert torch.equal(part.rowwise.dequantize(), h.rowwise.dequantize()[:, 32:])
    assert torch.equal(part.columnwise.dequantize(), h.columnwise.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="cannot be reshaped"):
        h.reshape(64, 32)


# ---- copy_ ---------------------------------------------------------------------------------------


def _requantize_like(t, x):
    """A tensor of t's format and metadata holding different values."""
    if isinstance(t, HybridTensor):
        return HybridTensor.from_hp(x, rowwise=NVFP4Spec(), columnwise=MXFP8Spec(),
                                    columnwise_source=t.columnwise_source)
    if isinstance(t, NVFP4Tensor):
        return NVFP4Tensor.from_hp(x, block_2d=t.block_2d, row_scaled=t.row_scaled,
                                   fourover6=t.fourover6, e4m3_bound=t.e4m3_bound, rht=t.rht,
                                   columnwise=t.axis == "columnwise")
    if isinstance(t, MXFP4Tensor):
        return MXFP4Tensor.from_spec(x, t.spec)
    return MXFP8Tensor.from_hp(x, scale_rule=t.scale_rule, columnwise=t.axis == "columnwise")


def test_copy_into_same_format(qt):
    src = _requantize_like(qt, _x(*qt.shape, seed=9))
    assert not torch.equal(src.dequantize(), qt.dequantize())
    ret = qt.copy_(src)
    assert ret is qt
    assert_same(qt, src)


def test_copy_errors():
    dst = NVFP4Tensor.from_hp(_x(32, 64))
    with pytest.raises(TypeError, match="NVFP4Tensor source; got Tensor.*Quantize the source"):
        dst.copy_(_x(32, 64))
    with pytest.raises(TypeError, match="got MXFP8Tensor"):
        dst.copy_(MXFP8Tensor.from_hp(_x(32, 64)))
    with pytest.raises(ValueError, match="e4m3_bound"):
        dst.copy_(NVFP4Tensor.from_hp(_x(32, 64), e4m3_bound=256))
