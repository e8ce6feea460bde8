"""The triton GEMM backend against the emulated reference, and backend resolution.

[Tolerance] Both paths multiply the same exact unit values (every product e2m1 x e4m3, and
e4m3 x 2^k for scale codes >= 10, is exact in bf16, and bf16 x bf16 is exact in fp32), and
apply the same fp32 epilogue in the same order. They differ only in the order of the fp32
additions (tile order, split-K), whose error is bounded by K * 2^-24 * sum_k |a_k b_k| per
element. So: the fp32 result's relative Frobenius error must be under 1e-5 (K <= 4096 here:
sqrt(K) * 2^-24 ~ 3e-6 for random signs); bf16 results must be equal except where the fp32 sum
sits on a bf16 rounding boundary: then they differ by one ulp, in well under 1% of elements.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qtensor import MXFP8Tensor, NVFP4Spec, NVFP4Tensor
from qtensor.backends import BackendPolicy, GemmBackend, resolve_gemm_backend
from qtensor.gemm.dense import emulated_mm, gemm_plan, operands, quantized_mm, with_gemm_backend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any()
    if out.dtype == torch.float32:
        err = (out - ref).norm() / ref.norm().clamp(min=1e-30)
        assert err < 1e-5, f"relative Frobenius error {err:.3e}"
        return
    o, r = out.view(torch.int16).int(), ref.view(torch.int16).int()
    ulps = (o - r).abs()
    assert ulps.max() <= 1, f"bf16 results differ by {ulps.max()} ulps"
    assert (ulps > 0).float().mean() < 0.01


def _operands(kind: str, x: torch.Tensor, w: torch.Tensor):
    """(left, right) of x @ w.t() in one of the supported combinations."""
    if kind == "nvfp4":
        return NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(w).t()
    if kind == "nvfp4_rowscaled":
        return (NVFP4Tensor.from_hp(x, row_scaled=True),
                NVFP4Tensor.from_hp(w, row_scaled=True).t())
    if kind == "nvfp4_bounds_448x256":
        return (NVFP4Tensor.from_hp(x, fourover6="mae", e4m3_bound=256),
                NVFP4Tensor.from_hp(w, block_2d=True).t())
    if kind == "mxfp8":
        return MXFP8Tensor.from_hp(x), MXFP8Tensor.from_hp(w).t()
    if kind == "bf16_nvfp4":
        return x.bfloat16(), NVFP4Tensor.from_hp(w, block_2d=True).t()
    if kind == "bf16_mxfp8":
        return x.bfloat16(), MXFP8Tensor.from_hp(w).t()
    raise AssertionError(kind)


KINDS = ["nvfp4", "nvfp4_rowscaled", "nvfp4_bounds_448x256", "mxfp8", "bf16_nvfp4", "bf16_mxfp8"]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,n,k", [(1, 208, 2080), (50, 208, 2080), (300, 272, 352)])
def test_dense_matches_reference(kind, m, n, k):
    """M, N, K off the tile sizes; m <= 64 runs split-K (K = 2080 gives two splits)."""
    g = torch.Generator("cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    a, b = _operands(kind, x, w)
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    assert gemm_plan(a, b, bias, torch.bfloat16) is GemmBackend.TRITON
    a_op, b_op = operands(a, b)
    for out_dtype, bias_ in ((torch.bfloat16, bias), (torch.float32, None)):
        out = quantized_mm(a, b, bias_, out_dtype=out_dtype)
        assert_matches_reference(out, emulated_mm(a_op, b_op, bias_, out_dtype))


def _decode_launches_made(monkeypatch) -> list:
    """The formats of the decode passes planned from now on (qgemm.DecodeLaunch made), in
    order."""
    from qtensor.kernels import qgemm

    made = []

    class Counted(qgemm.DecodeLaunch):
        __slots__ = ()

        def __init__(self, x, *args):
            made.append(x.fmt)
            super().__init__(x, *args)

    monkeypatch.setattr(qgemm, "DecodeLaunch", Counted)
    return made


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", KINDS)
def test_codes_in_kernel_and_decoded_first_match_reference(kind, monkeypatch):
    """[Note: codes in the tiled kernel]: a small product of more than DECODE_FIRST_M rows runs
    on the operands' codes with no decode pass; a larger one, one of too few output tiles for
    the SMs, and one with an operand strided along K (MXFP8 columnwise data, transposed) decode
    each quantized operand first; every way matches the reference, and the bf16 output is the
    fp32 one cast."""
    from qtensor.gemm.dense import triton_mm
    from qtensor.kernels import qgemm

    g = torch.Generator("cuda").manual_seed(11)
    m, n, k = 300, 272, 352
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    a, b = _operands(kind, x, w)
    a_op, b_op = operands(a, b)
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    ref = emulated_mm(a_op, b_op, bias, torch.float32)
    decodes = _decode_launches_made(monkeypatch)
    quantized = sum(type(t) is not torch.Tensor for t in (a, b))
    # (size limit, SMs, decode passes): codes; too many multiply-adds; too few output tiles
    # (9 here) for the SMs.
    for limit, sms, passes in ((qgemm.CODES_MAX_MNK, 2, 0), (0, 2, quantized),
                               (qgemm.CODES_MAX_MNK, 132, quantized)):
        monkeypatch.setattr(qgemm, "CODES_MAX_MNK", limit)
        monkeypatch.setattr(qgemm, "_sm_count", lambda index: sms)
        decodes.clear()
        out32 = triton_mm(a_op, b_op, bias, torch.float32)
        assert len([f for f in decodes if f != qgemm.FMT_HP]) == passes, (limit, decodes)
        assert_matches_reference(out32, ref)
        assert torch.equal(triton_mm(a_op, b_op, bias, torch.bfloat16), out32.bfloat16())
    # MXFP8 columnwise data [K, M] read as rows along K: a transpose view, strided along K.
    monkeypatch.setattr(qgemm, "CODES_MAX_MNK", 1 << 40)
    monkeypatch.setattr(qgemm, "_sm_count", lambda index: 2)
    cols = torch.zeros(k, m, dtype=torch.float8_e4m3fn, device="cuda")
    strided = qgemm.Operand(qgemm.FMT_MXFP8, cols.t(), torch.zeros(k // 32, m, dtype=torch.uint8,
                                                                   device="cuda").t())
    contiguous = qgemm.Operand(qgemm.FMT_MXFP8, cols.t().contiguous(), strided.scale)
    assert qgemm.takes_codes(contiguous, contiguous, m, n, k)
    assert not qgemm.takes_codes(strided, contiguous, m, n, k)
    assert not qgemm.takes_codes(contiguous, strided, m, n, k)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["nvfp4", "nvfp4_rowscaled", "mxfp8", "bf16_nvfp4"])
def test_product_plans_are_reused_per_layout(kind, monkeypatch):
    """[Note: product plans]: a dense op's call on new operands of a layout seen before runs
    that layout's plan (no new plan, no decode launch made) and matches the reference; a left
    operand at another 16-byte alignment gets a plan of its own; a bad argument still raises on
    its own signature; and while a CUDA graph is captured, a product that runs on its codes
    eagerly decodes each quantized operand first, and the replay matches the reference."""
    from qtensor.gemm.dense import dense_sides
    from qtensor.kernels import qgemm
    from qtensor.ops import gemm_ops, gemm_triton

    m, n, k = 300, 272, 352
    made = _decode_launches_made(monkeypatch)
    g = torch.Generator("cuda").manual_seed(21)
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()

    def pair():
        x = torch.randn(m, k, device="cuda", generator=g)
        return _operands(kind, x, torch.randn(n, k, device="cuda", generator=g) * 0.02)

    def check(a, b, out_dtype=torch.float32):
        out = quantized_mm(a, b, bias, out_dtype=out_dtype)
        assert_matches_reference(out, emulated_mm(*operands(a, b), bias, out_dtype))
        return out

    a, b = pair()
    quantized = sum(type(t) is not torch.Tensor for t in (a, b))
    # 9 output tiles: on codes for 2 SMs, decoded first for 132 (each decode planned once).
    for sms, decodes in ((2, 0), (132, quantized)):
        monkeypatch.setattr(qgemm, "_sm_count", lambda index: sms)
        gemm_triton.clear_plans()
        made.clear()
        check(a, b)
        plans = gemm_triton.plan_count()
        assert len(made) == decodes
        for _ in range(2):
            check(*pair())
        assert gemm_triton.plan_count() == plans and len(made) == decodes
    if type(a) is torch.Tensor:  # the activation one bf16 element off its 16-byte alignment
        wide = torch.empty(m, k + 8, device="cuda", dtype=torch.bfloat16)
        for start in (0, 1):
            wide[:, start:start + k] = a
            check(wide[:, start:start + k], b)
        assert gemm_triton.plan_count() == plans + 2
    # The op's checks run for every new signature (an integer output here).
    fmt, sa, sb, _ = dense_sides(*operands(a, b))
    with pytest.raises(ValueError, match="out_dtype"):
        gemm_ops.call(f"{fmt}_mm", *gemm_ops.dense_args(fmt, sa, sb, bias, torch.int32))
    # Under capture: decode first. The kernels it runs are compiled before the capture.
    monkeypatch.setattr(qgemm, "_sm_count", lambda index: 2)  # on codes eagerly
    a_op, b_op = operands(a, b)
    from qtensor.gemm.dense import triton_mm
    triton_mm(a_op, b_op, bias, torch.float32, predecode=True)
    made.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quantized_mm(a, b, bias, out_dtype=torch.float32)
    assert len(made) == quantized
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, emulated_mm(a_op, b_op, bias, torch.float32))
    gemm_triton.clear_plans()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["nvfp4", "nvfp4_rowscaled", "mxfp8", "bf16_nvfp4"])
@pytest.mark.parametrize("config", [(128, 256, 64, 8, 3, True), (128, 128, 64, 4, 4, False)])
def test_persistent_tma_kernel_matches_reference(kind, config):
    """The persistent TMA kernel ([Note: persistent TMA GEMM]) on decoded operands, forced on
    ragged M, N and K (its zero-filled loads and dropped stores) and with both epilogue forms;
    then a product large enough to take it by itself."""
    from qtensor.gemm.dense import triton_mm
    from qtensor.kernels import qgemm

    g = torch.Generator("cuda").manual_seed(3)
    for m, n, k, bias_dtype in ((300, 272, 352, torch.bfloat16), (1024, 2048, 4096, None)):
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        a, b = _operands(kind, x, w)
        a_op, b_op = operands(a, b)
        bias = None if bias_dtype is None else torch.randn(n, device="cuda", generator=g).to(
            bias_dtype)
        # fp32 against the reference by the accumulation-order bound; bf16 (and the bias, added
        # in fp32) then equal to the fp32 result cast: the epilogue and the cast are exact, and
        # a cancelling MXFP8 sum can sit many bf16 ulps from the reference's order.
        ref = emulated_mm(a_op, b_op, bias, torch.float32)
        runs = [lambda dt: triton_mm(a_op, b_op, bias, dt, config=qgemm.TmaConfig(*config),
                                     predecode=True)]
        if m * n * k >= qgemm.TMA_MIN_MNK:
            runs.append(lambda dt: quantized_mm(a, b, bias, out_dtype=dt))
        for run in runs:
            out32 = run(torch.float32)
            assert_matches_reference(out32, ref)
            assert torch.equal(run(torch.bfloat16), out32.bfloat16())


@pytest.mark.cuda
@cuda
def test_batched_and_3d_inputs():
    g = torch.Generator("cuda").manual_seed(3)
    a = NVFP4Tensor.from_hp(torch.randn(3, 40, 96, device="cuda", generator=g), row_scaled=True)
    b = NVFP4Tensor.from_hp(torch.randn(3, 72, 96, device="cuda", generator=g)).transpose(-1, -2)
    ref = emulated_mm(*operands(a, b), None, torch.float32)
    assert_matches_reference(torch.bmm(a, b), ref)  # aten.bmm routes through the layer
    assert_matches_reference(quantized_mm(a, b, out_dtype=torch.float32), ref)
    x = torch.randn(2, 5, 96, device="cuda", generator=g).bfloat16()  # 3-D activation, F.linear
    w = MXFP8Tensor.from_hp(torch.randn(80, 96, device="cuda", generator=g))
    out = torch.nn.functional.linear(x, w)
    ref = emulated_mm(*operands(x.reshape(-1, 96), w.t()), None, torch.bfloat16)
    assert_matches_reference(out.reshape(-1, 80), ref)


@pytest.mark.cuda
@cuda
def test_zero_operands_and_outliers():
    g = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(24, 128, device="cuda", generator=g)
    x[3, 17] = 3.0e4  # one outlier token: its row amax is 1e4 times the others'
    w = torch.randn(48, 128, device="cuda", generator=g)
    bias = torch.randn(48, device="cuda", generator=g)
    zero = NVFP4Tensor.from_hp(torch.zeros(24, 128, device="cuda"))
    out = quantized_mm(zero, NVFP4Tensor.from_hp(w).t(), bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(24, 48))
    for spec in ({}, {"row_scaled": True}):
        a, b = NVFP4Tensor.from_hp(x, **spec), NVFP4Tensor.from_hp(w, **spec).t()
        ref = emulated_mm(*operands(a, b), bias, torch.float32)
        assert_matches_reference(quantized_mm(a, b, bias, out_dtype=torch.float32), ref)


@pytest.mark.cuda
@cuda
def test_linear_routes_through_triton_and_backend_shows_in_repr():
    w = NVFP4Tensor.from_hp(torch.randn(64, 256, device="cuda"))
    assert w.gemm_backend == "triton" and "gemm_backend=triton" in repr(w)
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.nn.functional.linear(x, w)
    ref = torch.nn.functional.linear(x, with_gemm_backend(w, "emulated"))
    assert_matches_reference(out, ref)
    spec = NVFP4Spec(row_scaled=True, e4m3_bound=256)  # dynamic activation, quantized in F.linear
    wd = w.replace(act_spec=spec)
    out = torch.nn.functional.linear(x.reshape(2, 2, 256), wd)
    ref = torch.nn.functional.linear(x, with_gemm_backend(wd, "emulated"))
    assert_matches_reference(out.reshape(4, 64), ref)
    moved = w.to("cpu")
    assert moved.gemm_backend == "emulated"
    assert moved.to("cuda").gemm_backend == "triton"


# ---- CPU: backend resolution and routing ----------------------------------------------------


def test_cpu_tensors_resolve_to_emulated():
    w = NVFP4Tensor.from_hp(torch.randn(32, 64))
    assert w.gemm_backend == "emulated" and "gemm_backend=emulated" in repr(w)
    assert resolve_gemm_backend("cpu") is GemmBackend.EMULATED
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert gemm_plan(x, w.t()) is GemmBackend.EMULATED


def test_override_that_cannot_run_raises():
    w = MXFP8Tensor.from_hp(torch.randn(32, 64))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        with_gemm_backend(w, "triton")
    with pytest.raises(ValueError, match="is not a valid GemmBackend"):
        with_gemm_backend(w, "cublas")


def test_env_policy_is_validated():
    policy = BackendPolicy.from_env({"QTENSOR_GEMM_BACKEND": "emulated"})
    assert policy.gemm_override is GemmBackend.EMULATED
    with pytest.raises(ValueError, match="QTENSOR_GEMM_BACKEND must be one of"):
        BackendPolicy.from_env({"QTENSOR_GEMM_BACKEND": "fast"})


def test_mixed_formats_raise():
    a = NVFP4Tensor.from_hp(torch.randn(16, 64))
    b = MXFP8Tensor.from_hp(torch.randn(32, 64)).t()
    with pytest.raises(TypeError, match="both operands in one format"):
        quantized_mm(a, b)


def test_import_does_not_load_triton():
    code = "import sys, qtensor, torch; qtensor.NVFP4Tensor.from_hp(torch.randn(16, 32)); " \
           "print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.cuda
@cuda
def test_direct_launch_equals_tritons_own_launch(monkeypatch):
    """[Note: direct launch]: the cached compiled kernels launched directly give the bytes
    Triton's own launch gives, for split-K decode shapes, large M, grouped, an operand whose
    pointer is not 16-byte aligned (a key of its own), and the persistent kernels, whose TMA
    descriptors are keys too; no launch fell back."""
    from qtensor.kernels import grouped_qgemm, qgemm
    from qtensor.ops import gemm_triton

    launchers = [qgemm._QGEMM, qgemm._SPLITK_EPILOGUE, qgemm._DECODE, grouped_qgemm._GROUPED]
    persistent = [qgemm._TMA_GEMM, grouped_qgemm._GROUPED_TMA]
    has_tma = qgemm.TensorDescriptor is not None and torch.cuda.get_device_capability()[0] >= 9
    g = torch.Generator("cuda").manual_seed(9)
    w = torch.randn(208, 2080, device="cuda", generator=g)
    wide = torch.randn(300, 2081, device="cuda", generator=g).bfloat16()
    offs = torch.tensor([17, 40], dtype=torch.int32, device="cuda")

    def grouped(tokens=wide[:40, :2080]):
        return torch._grouped_mm(
            tokens, NVFP4Tensor.from_hp(w.reshape(2, 104, 2080)).transpose(-1, -2), offs)

    def large():
        return quantized_mm(NVFP4Tensor.from_hp(wide[:, :2080].float()), NVFP4Tensor.from_hp(w).t())

    def persistent_kernels(fn):
        def run():
            with monkeypatch.context() as m:  # these products are far below the size limits
                m.setattr(qgemm, "TMA_MIN_MNK", 0)
                m.setattr(grouped_qgemm, "TMA_MIN_MNK", 0)
                gemm_triton.clear_plans()  # planned under the limits in force
                try:
                    return fn()
                finally:
                    gemm_triton.clear_plans()
        return run

    cases = {
        "split-K bf16 x NVFP4": lambda: torch.nn.functional.linear(
            wide[:1, :2080], NVFP4Tensor.from_hp(w)),
        "misaligned bf16 x MXFP8": lambda: torch.nn.functional.linear(
            wide[:5, 1:], MXFP8Tensor.from_hp(w)),
        "M=300 NVFP4 x NVFP4": large,
        "grouped": grouped,
    }
    if has_tma:
        launchers += persistent
        cases["persistent M=300 NVFP4 x NVFP4"] = persistent_kernels(large)
        # The persistent grouped kernel takes TMA-aligned token rows.
        aligned = wide[:40, :2080].contiguous()
        cases["persistent grouped"] = persistent_kernels(lambda: grouped(aligned))
    for name, fn in cases.items():
        fn()  # first launch of each key: Triton's path, which fills the cache
        direct = fn()
        assert all(lnc.direct for lnc in launchers), f"{name}: a direct launch fell back"
        for lnc in launchers:
            lnc.direct = False
        try:
            own = fn()
        finally:
            for lnc in launchers:
                lnc.direct = True
        assert torch.equal(direct, own), name
    assert all(len(lnc.cache) for lnc in launchers)
