"""Products grouped along K (a grouped linear's weight gradients): qtensor::*_grouped_mm_k and
`qtensor.gemm.grouped.grouped_mm_k` against each expert's own dense product.

The oracles are the dense layer run expert by expert on that expert's own quantized tensors
(`quantized_mm_t`, as a TrainingLinear's wgrad runs it), bitwise on the CPU, and the fp64
product of their dequantized values, which shares no code with the grouped op.
"""

from __future__ import annotations

import pytest
import torch

from qtensor import MXFP8Tensor, NVFP4Tensor
from qtensor.gemm.dense import quantized_mm_t
from qtensor.gemm.grouped import grouped_mm_k
from qtensor.ops import gemm_k
from qtensor.ops.gemm_operands import NVFP4, Side

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Experts 1 and 4 own no tokens; every count a multiple of 32 (MXFP8 blocks).
SPLITS = [64, 0, 96, 32, 0, 128]
KINDS = ["nvfp4", "nvfp4_rowscaled", "nvfp4_rht", "nvfp4_bound256", "mxfp8"]


def _cast(kind: str, t: torch.Tensor):
    """t [m, C] quantized columnwise (blocks along the tokens) with its own amax."""
    if kind == "mxfp8":
        return MXFP8Tensor.from_hp(t, columnwise=True)
    kw = {"nvfp4_rowscaled": {"row_scaled": True}, "nvfp4_rht": {"rht": True},
          "nvfp4_bound256": {"e4m3_bound": 256}}.get(kind, {})
    return NVFP4Tensor.from_hp(t, columnwise=True, **kw)


def _experts(kind: str, m_out=48, n_out=80, device="cpu", seed=0, splits=SPLITS):
    """(dY parts [m_e, M], X parts [m_e, N], offs): each expert's own casts, None where it has no
    tokens; the experts' scales differ by powers of 4 so no two share an amax."""
    g = torch.Generator(device).manual_seed(seed)
    dys, xs = [], []
    for e, m in enumerate(splits):
        if m == 0:
            dys.append(None)
            xs.append(None)
            continue
        dy = torch.randn(m, m_out, device=device, generator=g) * 4.0**-e
        x = torch.randn(m, n_out, device=device, generator=g) * 4.0**e
        dys.append(_cast(kind, dy))
        xs.append(_cast(kind, x))
    offs = torch.tensor(splits, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    return dys, xs, offs


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_is_each_experts_own_product(kind):
    dys, xs, offs = _experts(kind)
    out = grouped_mm_k(dys, xs, torch.float32)
    assert out.shape == (len(SPLITS), 48, 80)
    for e, (dy, x) in enumerate(zip(dys, xs)):
        if dy is None:
            assert torch.equal(out[e], torch.zeros(48, 80)), f"expert {e}"
        else:
            want = quantized_mm_t(dy, x, out_dtype=torch.float32, a_t=True)
            assert torch.equal(out[e], want), f"expert {e}"


@pytest.mark.parametrize("kind", ["nvfp4", "nvfp4_rowscaled", "nvfp4_bound256", "mxfp8"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_fp64_product_of_the_dequantized_parts(kind, out_dtype):
    dys, xs, offs = _experts(kind, seed=1)
    out = grouped_mm_k(dys, xs, out_dtype)
    assert out.dtype == out_dtype
    for e, (dy, x) in enumerate(zip(dys, xs)):
        if dy is None:
            continue
        want = dy.dequantize(torch.float32).double().t() @ x.dequantize(torch.float32).double()
        err = (out[e].double() - want).abs().max() / want.abs().max()
        assert err < (1e-6 if out_dtype == torch.float32 else 2.0**-8), f"expert {e}: {err}"


def _sides(kind="nvfp4"):
    dys, xs, offs = _experts(kind)
    from qtensor.gemm.grouped import _cat, _k_parts

    fmt, a_sides, b_sides, _ = _k_parts(dys, xs)
    return fmt, _cat(fmt, a_sides, dys), _cat(fmt, b_sides, dys), offs


def test_op_layout_per_expert_amax():
    fmt, a, b, offs = _sides()
    assert fmt == NVFP4 and a.amax.shape == (len(SPLITS),) and b.amax.shape == (len(SPLITS),)
    assert a.data.shape == (48, sum(SPLITS) // 2) and b.scale.shape == (80, sum(SPLITS) // 16)
    assert a.amax[1] == 0 and a.amax[0] > 0
    fmt, a, _, _ = _sides("nvfp4_rowscaled")
    assert a.amax.shape == (len(SPLITS), 48)


def test_op_checks_its_arguments():
    fmt, a, b, offs = _sides()
    op = gemm_k.grouped_mm_k
    with pytest.raises(ValueError, match="offs must be int32"):
        op(fmt, a, b, offs.long(), torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        op(fmt, a, b, offs - 8, torch.float32)
    with pytest.raises(ValueError, match="non-decreasing"):
        op(fmt, a, b, offs.flip(0), torch.float32)
    with pytest.raises(ValueError, match=r"a_amax must be one value per expert \[6\]"):
        op(fmt, Side(a.data, a.scale, a.amax[:3], a.bound), b, offs, torch.float32)
    with pytest.raises(ValueError, match="both operands must be quantized"):
        op(fmt, Side(a.data.float()), b, offs, torch.float32)
    with pytest.raises(ValueError, match="K differs"):
        op(fmt, Side(a.data[:, :-8], a.scale[:, :-1], a.amax, a.bound), b, offs, torch.float32)


def test_layer_checks_its_arguments():
    dys, xs, _ = _experts("nvfp4")
    with pytest.raises(ValueError, match="one .a, b. pair per expert"):
        grouped_mm_k(dys[:-1], xs, torch.float32)
    with pytest.raises(ValueError, match="no expert holds operands"):
        grouped_mm_k([None] * 6, [None] * 6, torch.float32)
    with pytest.raises(ValueError, match="expert 2's parts must both be None or hold the same"):
        grouped_mm_k(dys, xs[:2] + [xs[0]] + xs[3:], torch.float32)
    with pytest.raises(ValueError, match="expert 1's parts must both be None"):
        grouped_mm_k(dys, xs[:1] + [xs[0]] + xs[2:], torch.float32)
    _, mx, _ = _experts("mxfp8")
    with pytest.raises(TypeError, match="one format"):
        grouped_mm_k(dys, mx, torch.float32)


def test_high_precision_parts_run_expert_by_expert():
    dys, xs, offs = _experts("nvfp4")
    hp = [None if x is None else x.dequantize(torch.float32).bfloat16() for x in xs]
    out = grouped_mm_k(dys, hp, torch.float32)
    for e, (dy, x) in enumerate(zip(dys, hp)):
        if dy is not None:
            assert torch.equal(out[e], quantized_mm_t(dy, x, out_dtype=torch.float32, a_t=True))


def test_compiles_fullgraph():
    dys, xs, offs = _experts("nvfp4_rowscaled")
    fn = torch.compile(lambda d, x: grouped_mm_k(d, x, torch.float32), fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(dys, xs), grouped_mm_k(dys, xs, torch.float32))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_kernel_matches_reference_and_each_expert(kind):
    # Off-tile M and N, 128-token experts beside 32- and 0-token ones: the Triton kernel against
    # the reference op on the same bytes (the fp32 sums in another order) and each expert's
    # own dense product on the GPU; empty experts exactly zero.
    splits = [128, 0, 32, 256, 0, 96, 160, 64]
    dys, xs, offs = _experts(kind, m_out=208, n_out=144, device="cuda", seed=2, splits=splits)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = grouped_mm_k(dys, xs, out_dtype)
        from qtensor.gemm.grouped import _cat, _k_parts

        fmt, a_sides, b_sides, _ = _k_parts(dys, xs)
        ref = gemm_k.reference_grouped_mm_k(fmt, _cat(fmt, a_sides, dys),
                                            _cat(fmt, b_sides, dys), offs, out_dtype)
        for e, (dy, x) in enumerate(zip(dys, xs)):
            if dy is None:
                assert not out[e].any(), f"expert {e}"
                continue
            dense = quantized_mm_t(dy, x, out_dtype=out_dtype, a_t=True).float()
            for want in (ref[e].float(), dense):
                tol = (1e-5 if out_dtype == torch.float32 else 2.0**-7) * want.abs() + \
                    1e-6 * want.abs().max()
                assert ((out[e].float() - want).abs() <= tol).all(), f"expert {e}"
