"""Quantization ops: the kernels of csrc/ (torch.ops.qtensor.*), their fake implementations for
torch.compile, and the one dispatch point the tensor subclasses call.

The backend is chosen once per device type by qtensor/backends/choice.py ([Note: quantization
backends] there): the CUDA kernels on a GPU, the C++ kernels on the CPU, the pure-torch
reference of qtensor/formats when the extension is not built (or QTENSOR_QUANT_BACKEND=reference).
Stochastic rounding draws its bits from a counter hash of (seed, offset) (`SRSeed`), which the
ops take as an int64 tensor [2] on the data's device (`sr_state`): a training module passes its
buffer (compiled graphs advance it in place, no host sync), a generator is turned into one by a
single draw here (eager only), and every backend rounds the same way.
"""

from __future__ import annotations

import torch

from qtensor.backends import EXTENSION_ERROR, QuantBackend, quant_backend
from qtensor.backends import extension_status  # noqa: F401  (docs/kernels.md names it here)
from qtensor.formats import mxfp4, mxfp8, nvfp4
from qtensor.formats.mxfp8 import MXFP8Data, MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Data, NVFP4Spec, SRSeed, check_sr_state, sr_state_tensor

_FOUROVERSIX = {None: 0, "mae": 1, "mse": 2}
_SCALE_RULE = {"rceil": 0, "floor": 1}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # decode outputs of the ops


# ---- typed wrappers over the ops -----------------------------------------------------------------


def amax(x: torch.Tensor, *, columnwise=False, rht=False, per_row=False) -> torch.Tensor:
    """max|x| (fp32): scalar, or per row of the quantized matrix; RHT'd runs with `rht`."""
    return torch.ops.qtensor.amax.default(x, columnwise, rht, per_row)


def nvfp4_codes(x, amax_t, spec: NVFP4Spec, sr: SRSeed | torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, C/2], scales e4m3 [R, C/16]) of x given its amax; `sr` is the
    stochastic-rounding (seed, offset) as an SRSeed or an int64 state tensor on x's device."""
    state = sr_state_tensor(sr, x.device) if isinstance(sr, SRSeed) else sr
    return torch.ops.qtensor.nvfp4_quantize.default(
        x, amax_t, spec.columnwise, spec.block_2d, _FOUROVERSIX[spec.fourover6],
        spec.e4m3_bound, spec.rht, spec.stochastic_rounding, state,
    )


def mxfp8_both(x: torch.Tensor, scale_rule: str, rowwise: bool, columnwise: bool):
    """(row data, row scale, col data, col scale) from one read; a side not asked for is empty."""
    return torch.ops.qtensor.mxfp8_quantize.default(x, _SCALE_RULE[scale_rule], rowwise, columnwise)


def swizzle_scale(scale: torch.Tensor) -> torch.Tensor:
    """Compact [rows, cols] scales -> the GEMM's swizzled layout (formats/scale_layout.py)."""
    return torch.ops.qtensor.swizzle_scale.default(scale)


def unswizzle_scale(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.ops.qtensor.unswizzle_scale.default(scale, rows, cols)


# ---- the dispatch point ------------------------------------------------------------------------


def sr_state(generator: torch.Generator | SRSeed | torch.Tensor | None, device) -> torch.Tensor:
    """Stochastic rounding's int64 state (seed, offset) on `device`: a state tensor as given, an
    SRSeed's pair, or (seed drawn once from the generator, 0). The draw reads a
    torch.Generator, which torch.compile cannot trace: compiled code passes a state tensor."""
    if isinstance(generator, torch.Tensor):
        check_sr_state(generator, device)
        return generator
    if isinstance(generator, SRSeed):
        return sr_state_tensor(generator, device)
    gen_device = generator.device if generator is not None else "cpu"
    seed = torch.randint(0, 2**31 - 1, (), generator=generator, device=gen_device)
    return torch.stack([seed, torch.zeros_like(seed)]).to(device)


def quantize_nvfp4(x, spec: NVFP4Spec, generator=None, global_amax=None
                   ) -> tuple[NVFP4Data, QuantBackend]:
    """NVFP4 bytes of x (2-D [R, C] results, as nvfp4.quantize) and the backend that made them.
    `global_amax` replaces x's own amax (an FSDP shard quantized with its weight's amax)."""
    backend = quant_backend(x.device)
    sr = sr_state(generator, x.device) if spec.stochastic_rounding else None
    if backend is QuantBackend.REFERENCE:
        return nvfp4.quantize(x, spec, sr, amax=global_amax), backend
    nvfp4.check_shape(x.shape, spec)  # the same ValueError as the reference, before any kernel
    a = global_amax if global_amax is not None else amax(
        x, columnwise=spec.columnwise, rht=spec.rht, per_row=spec.row_scaled)
    qdata, scale = nvfp4_codes(x, a, spec, sr)
    return NVFP4Data(qdata, scale, a), backend


def nvfp4_row_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| (fp32) of each row of a 2-D x, reduced as quantize_nvfp4 reduces a row-scaled
    amax on x's backend."""
    if quant_backend(x.device) is QuantBackend.REFERENCE:
        return nvfp4.row_amax(x)
    return amax(x, per_row=True)


def _mx_kernel_ok(x: torch.Tensor, backend: QuantBackend, columnwise: bool) -> bool:
    # The CUDA kernel reads 16-element row chunks; the reference takes any K for columnwise.
    return backend is not QuantBackend.REFERENCE and not (
        backend is QuantBackend.CUDA and columnwise and x.shape[-1] % 16
    )


def quantize_mxfp8(x, spec: MXFP8Spec) -> tuple[MXFP8Data, QuantBackend]:
    """MXFP8 bytes of x (as mxfp8.quantize) and the backend that made them."""
    backend = quant_backend(x.device)
    if not _mx_kernel_ok(x, backend, spec.columnwise):
        return mxfp8.quantize(x, spec), QuantBackend.REFERENCE
    mxfp8.check_shape(x.shape, spec)
    rq, rs, cq, cs = mxfp8_both(x, spec.scale_rule, not spec.columnwise, spec.columnwise)
    return (MXFP8Data(cq, cs) if spec.columnwise else MXFP8Data(rq, rs)), backend


def quantize_hybrid_grad(x, scale_rule: str, spec: NVFP4Spec, generator=None):
    """(MXFP8 rowwise, NVFP4 columnwise, backend) of a 2-D gradient from one read of it: the
    dgrad-in-MXFP8 recipe's grad_output cast. `spec` is the columnwise NVFP4 spec (RHT, SR, 4over6
    as the recipe says)."""
    if not spec.columnwise:
        raise ValueError(f"the hybrid gradient cast takes a columnwise NVFP4 spec; got {spec}.")
    backend = quant_backend(x.device)
    sr = sr_state(generator, x.device) if spec.stochastic_rounding else None
    if backend is QuantBackend.REFERENCE:
        return mxfp8.quantize(x, MXFP8Spec(scale_rule)), nvfp4.quantize(x, spec, sr), backend
    a = amax(x, columnwise=True, rht=spec.rht, per_row=spec.row_scaled)
    rq, rs, nq, ns = torch.ops.qtensor.hybrid_quantize.default(
        x, a, _SCALE_RULE[scale_rule], _FOUROVERSIX[spec.fourover6], spec.e4m3_bound, spec.rht,
        spec.stochastic_rounding, sr,
    )
    return MXFP8Data(rq, rs), NVFP4Data(nq, ns, a), backend


def dequantize_nvfp4(qdata, scale, amax_t, e4m3_bound: int, dtype=torch.float32) -> torch.Tensor:
    """Decode 2-D NVFP4 storage [R, C/2] to [R, C] in `dtype` (as nvfp4.dequantize)."""
    if quant_backend(qdata.device) is QuantBackend.REFERENCE:
        return nvfp4.dequantize(qdata, scale, amax_t, e4m3_bound, dtype)
    kdtype = dtype if dtype in _KERNEL_DTYPES else torch.float32  # fp32 decode is exact
    out = torch.ops.qtensor.nvfp4_dequantize.default(qdata, scale, amax_t, e4m3_bound, kdtype)
    return out.to(dtype)


def dequantize_mxfp8(qdata, scale, columnwise: bool, dtype=torch.float32) -> torch.Tensor:
    """Decode MXFP8 to the input's layout in `dtype` (as mxfp8.dequantize)."""
    backend = quant_backend(qdata.device)
    if backend is QuantBackend.REFERENCE or (backend is QuantBackend.CUDA and qdata.shape[-1] % 16):
        return mxfp8.dequantize(qdata, scale, columnwise, dtype)
    kdtype = dtype if dtype in _KERNEL_DTYPES else torch.float32
    return torch.ops.qtensor.mxfp8_dequantize.default(qdata, scale, columnwise, kdtype).to(dtype)


def fake_quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 projection of a weight with a straight-through gradient (as mxfp4.fake_quantize)."""
    if quant_backend(w.device) is QuantBackend.REFERENCE or w.dtype not in mxfp4_dtypes():
        return mxfp4.fake_quantize(w)  # also raises the dtype error
    mxfp4.check_shape(w.shape)
    return torch.ops.qtensor.mxfp4_fake_quantize.default(w)


def mxfp4_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.bfloat16, torch.float32)


# ---- fake (meta) implementations and autograd ---------------------------------------------------


def _register_fakes() -> None:
    lib = "qtensor::"

    @torch.library.register_fake(lib + "amax")
    def _(x, columnwise, rht, per_row):
        k = x.shape[-1]
        rows = k if columnwise else x.numel() // k
        return x.new_empty((rows,) if per_row else (), dtype=torch.float32)

    @torch.library.register_fake(lib + "nvfp4_quantize")
    def _(x, amax, columnwise, block_2d, fourover6, bound, rht, stochastic, sr_state, walk=0):
        k = x.shape[-1]
        m = x.numel() // k
        r, c = (k, m) if columnwise else (m, k)
        q = x.new_empty((r, c // 2), dtype=torch.uint8)
        return q, x.new_empty((r, c // 16), dtype=torch.float8_e4m3fn)

    def _mx_outputs(x, rowwise, columnwise):
        k = x.shape[-1]
        empty = x.new_empty((0,), dtype=torch.uint8)
        rq = x.new_empty(x.shape, dtype=torch.float8_e4m3fn) if rowwise else empty.view(torch.float8_e4m3fn)
        rs = (x.new_empty((*x.shape[:-1], k // 32), dtype=torch.float8_e8m0fnu) if rowwise
              else empty.view(torch.float8_e8m0fnu))
        cq = x.new_empty(x.shape, dtype=torch.float8_e4m3fn) if columnwise else empty.view(torch.float8_e4m3fn)
        cs = (x.new_empty((x.numel() // k // 32, k), dtype=torch.float8_e8m0fnu) if columnwise
              else empty.view(torch.float8_e8m0fnu))
        return rq, rs, cq, cs

    @torch.library.register_fake(lib + "mxfp8_quantize")
    def _(x, scale_rule, rowwise, columnwise):
        return _mx_outputs(x, rowwise, columnwise)

    @torch.library.register_fake(lib + "hybrid_quantize")
    def _(x, amax, scale_rule, fourover6, bound, rht, stochastic, sr_state, walk=0):
        rq, rs, _, _ = _mx_outputs(x, True, False)
        m, k = x.shape
        return rq, rs, x.new_empty((k, m // 2), dtype=torch.uint8), x.new_empty(
            (k, m // 16), dtype=torch.float8_e4m3fn
        )

    @torch.library.register_fake(lib + "nvfp4_dequantize")
    def _(qdata, scale, amax, bound, dtype):
        return qdata.new_empty((qdata.shape[0], qdata.shape[1] * 2), dtype=dtype)

    @torch.library.register_fake(lib + "mxfp8_dequantize")
    def _(qdata, scale, columnwise, dtype):
        return qdata.new_empty(qdata.shape, dtype=dtype)

    @torch.library.register_fake(lib + "mxfp4_fake_quantize")
    def _(w):
        return torch.empty_like(w)

    @torch.library.register_fake(lib + "swizzle_scale")
    def _(scale):
        rows, cols = scale.shape
        return scale.new_empty((-(-rows // 128) * 128, -(-cols // 4) * 4))

    @torch.library.register_fake(lib + "unswizzle_scale")
    def _(scale, rows, cols):
        return scale.new_empty((rows, cols))

    # The projection's gradient is straight-through (identity), as in mxfp4.fake_quantize.
    torch.library.register_autograd(lib + "mxfp4_fake_quantize", lambda ctx, grad: grad)


if EXTENSION_ERROR is None:
    _register_fakes()
