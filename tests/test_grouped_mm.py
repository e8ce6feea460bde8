"""torch._grouped_mm on quantized operands: the grouped reference against dense per-expert
products, routing through the op table, errors, and the Triton kernel on the GPU.

The independent oracle for the grouped reference is the dense layer run expert by expert on
sliced operands (slicing quantized tensors touches no byte), so the grouped code's offsets,
per-token and per-expert factors and bias indexing are checked against code that has none.
"""

from __future__ import annotations

import pytest
import torch

from qtensor import MXFP8Tensor, NVFP4Tensor
from qtensor.backends import GemmBackend
from qtensor.gemm.dense import emulated_mm, operands, quantized_mm
from qtensor.gemm.grouped import grouped_mm, grouped_mm_reference, grouped_plan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _moe(kind: str, t: int, e: int, k: int, n: int, device="cpu", seed=0):
    """(tokens [T, K], expert weights as the right operand [E, K, N])."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, k, device=device, generator=g)
    w = torch.randn(e, n, k, device=device, generator=g) * 0.05
    if kind == "nvfp4":
        return NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(w).transpose(-1, -2)
    if kind == "nvfp4_rowscaled":
        return (NVFP4Tensor.from_hp(x, row_scaled=True),
                NVFP4Tensor.from_hp(w, row_scaled=True).transpose(-1, -2))
    if kind == "bf16_nvfp4":
        return x.bfloat16(), NVFP4Tensor.from_hp(w, row_scaled=True).transpose(-1, -2)
    if kind == "mxfp8":
        return MXFP8Tensor.from_hp(x), MXFP8Tensor.from_hp(w).transpose(-1, -2)
    if kind == "bf16_mxfp8":
        return x.bfloat16(), MXFP8Tensor.from_hp(w).transpose(-1, -2)
    raise AssertionError(kind)


KINDS = ["nvfp4", "nvfp4_rowscaled", "bf16_nvfp4", "mxfp8", "bf16_mxfp8"]
# Experts 1 and 4 own no tokens; rows 45..47 belong to none and come out zero.
OFFS = [9, 9, 30, 45, 45]


@pytest.mark.parametrize("kind", KINDS)
def test_reference_equals_dense_per_expert(kind):
    a, b = _moe(kind, t=48, e=5, k=64, n=40)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    bias = torch.randn(5, 40)
    out = grouped_mm_reference(*operands(a, b), offs, bias, torch.float32)
    assert out.shape == (48, 40)
    start = 0
    for e, end in enumerate(OFFS):
        a_e, b_e = a[start:end], b[e]
        if end > start:
            dense = emulated_mm(*operands(a_e, b_e), bias[e], torch.float32)
            assert torch.equal(out[start:end], dense), f"expert {e}"
        start = end
    assert torch.equal(out[45:], torch.zeros(3, 40))


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_op_is_the_dense_op_per_expert(kind):
    # The CPU op runs each expert's rows through the dense CPU product, so each expert's rows
    # are bitwise a dense product of that expert's operands (what a grouped linear's parity
    # with independent linears rests on), and the reference's up to the fp32 addition order.
    a, b = _moe(kind, t=48, e=5, k=64, n=40, seed=3)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    bias = torch.randn(5, 40)
    out = torch._grouped_mm(a, b, offs, bias, torch.float32)
    start = 0
    for e, end in enumerate(OFFS):
        if end > start:
            dense = quantized_mm(a[start:end], b[e], bias[e], torch.float32)
            assert torch.equal(out[start:end], dense), f"expert {e}"
        start = end
    assert torch.equal(out[45:], torch.zeros(3, 40))
    ref = grouped_mm_reference(*operands(a, b), offs, bias, torch.float32)
    assert (out - ref).norm() / ref.norm() < 1e-6


def test_default_out_dtype_and_no_bias():
    a, b = _moe("nvfp4", t=16, e=2, k=32, n=16)
    out = torch._grouped_mm(a, b, torch.tensor([7, 16], dtype=torch.int32))
    assert out.dtype == a.dtype and out.shape == (16, 16)


def test_bad_arguments_raise():
    a, b = _moe("mxfp8", t=16, e=2, k=64, n=16)
    with pytest.raises(ValueError, match="offs must be int32"):
        grouped_mm(a, b, torch.tensor([7, 16]))
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(a, b, torch.tensor([9, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"grouped bias must be \[E, N\]"):
        grouped_mm(a, b, torch.tensor([7, 16], dtype=torch.int32), torch.zeros(16))
    nv, _ = _moe("nvfp4", t=16, e=2, k=64, n=16)
    with pytest.raises(TypeError, match="one format"):
        grouped_mm(nv, b, torch.tensor([7, 16], dtype=torch.int32))


def test_cpu_plan_is_emulated():
    a, b = _moe("bf16_nvfp4", t=16, e=2, k=32, n=16)
    assert grouped_plan(*operands(a, b), None, torch.bfloat16) is GemmBackend.EMULATED


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kernel", ["persistent, codes", "persistent, decoded", "tiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_grouped_matches_reference(kind, kernel, monkeypatch):
    # 8 experts over 700 tokens, two empty, off-tile K and N; rows 690.. belong to none.
    from qtensor.kernels import grouped_qgemm, qgemm

    a, b = _moe(kind, t=700, e=8, k=352, n=200, device="cuda", seed=1)
    offs = torch.tensor([100, 100, 233, 400, 401, 401, 650, 690], dtype=torch.int32,
                        device="cuda")
    bias = torch.randn(8, 200, device="cuda").bfloat16()
    a_op, b_op = operands(a, b)
    assert grouped_plan(a_op, b_op, bias, torch.bfloat16) is GemmBackend.TRITON
    weights = []  # the weight operand's format of each persistent launch
    persistent = grouped_qgemm._grouped_tma
    monkeypatch.setattr(grouped_qgemm, "_grouped_tma",
                        lambda *args: weights.append(args[1].fmt) or persistent(*args))
    monkeypatch.setattr(grouped_qgemm, "STREAM_WEIGHT_CODES", kernel == "persistent, codes")
    monkeypatch.setattr(grouped_qgemm, "TMA_MIN_MNK", 0)  # this product is far smaller
    if kernel == "tiled":
        monkeypatch.setattr(grouped_qgemm, "tma_problem", lambda *args: "the test's choice")
    for calls, out_dtype in enumerate((torch.float32, torch.bfloat16), 1):
        out = torch._grouped_mm(a, b, offs, bias, out_dtype)
        # Every operand is aligned here and the size limit is off, so the sm_90+ GPUs these
        # tests run on take the persistent kernel, on the weight's codes or decoded as the case
        # says.
        want = {"persistent, codes": [qgemm.FMT_NVFP4 if "nvfp4" in kind else qgemm.FMT_MXFP8],
                "persistent, decoded": [qgemm.FMT_HP], "tiled": []}[kernel]
        assert weights == want * calls
        ref = grouped_mm_reference(a_op, b_op, offs, bias, out_dtype)
        assert torch.equal(out[690:], torch.zeros_like(out[690:]))
        if out_dtype == torch.float32:
            err = (out - ref).norm() / ref.norm()
            assert err < 1e-5, f"relative Frobenius error {err:.3e}"  # accumulation order only
        else:
            # bf16 outputs: the fp32 result rounded once, up to the fp32 accumulation order. Near
            # a cancellation a reordering can move the rounded value by several ulps (seen: 3 on
            # the H200, where split-K sums in a run-dependent order), so the bound is the bf16
            # rounding of the fp32 reference plus an order term on the scale of the row.
            ref32 = grouped_mm_reference(a_op, b_op, offs, bias, torch.float32)
            scale = ref32.norm(dim=-1, keepdim=True) / ref32.shape[-1] ** 0.5
            tol = 2.0**-8 * ref32.abs() + 1e-5 * scale
            assert ((out.float() - ref32).abs() <= tol).all()
            ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
            assert (ulps > 0).float().mean() < 0.01
