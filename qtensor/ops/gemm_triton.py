"""The CUDA kernel of the dense and grouped GEMM ops: the Triton kernels of qtensor/kernels where
they apply (`triton_problem`), with each dense product planned once per layout of its arguments
([Note: product plans]). qtensor/ops/gemm_ops.py registers the ops and falls back to the
reference where these return nothing.
"""

from __future__ import annotations

import functools

import torch

from qtensor.backends import GemmBackend, gemm_backend_problem
from qtensor.ops.gemm_operands import (
    FLOAT_DTYPES,
    NO_KERNEL,
    NVFP4,
    Side,
    check_dense,
    epilogue_terms,
    fresh_reshape,
    reduction_k,
)


@functools.lru_cache(maxsize=None)
def _triton_device_problem(index: int) -> str | None:
    return gemm_backend_problem(GemmBackend.TRITON, f"cuda:{index}")


def device_ok(a: Side) -> bool:
    """Whether Triton runs on this GPU (chosen once per device; the tensors' triton backend was
    resolved against the same check when they were made)."""
    return _triton_device_problem(a.data.device.index or 0) is None


def triton_problem(a: Side, b: Side, bias, out_dtype, grouped=False) -> str | None:
    """Why the Triton kernels cannot run this product (then the reference does), or None."""
    if not b.quantized:
        return "the right operand is high precision"
    if not a.quantized and a.data.dtype != torch.bfloat16:
        return f"a high-precision left operand must be bfloat16 to be exact; got {a.data.dtype}"
    if a.data.device.type != "cuda":
        return "the operands are not on a CUDA device"
    if out_dtype not in FLOAT_DTYPES:
        return f"the kernels write float32, bfloat16 or float16; got {out_dtype}"
    if not grouped and bias is not None and (bias.dim() != 1 or bias.shape[0] != b.data.shape[-2]):
        return "the bias is not a vector [N]"
    if a.data.numel() == 0 or b.data.numel() == 0:
        return "an operand is empty"
    return None


def kernel_operand(fmt: str, s: Side, kernels):
    if not s.quantized:
        return kernels.Operand(kernels.FMT_HP, s.data, None)
    if fmt == NVFP4:
        return kernels.Operand(kernels.FMT_NVFP4, s.data, s.scale)
    return kernels.Operand(kernels.FMT_MXFP8, s.data, s.scale.view(torch.uint8))


def triton_mm(fmt: str, a: Side, b: Side, bias, out_dtype, config=None, predecode=None):
    """The Triton product. Up to qgemm.DECODE_FIRST_M rows the weight streams and is decoded in
    registers, and a quantized left operand's few rows are decoded once up front rather than
    once per N tile. Above it, small products run on both operands' codes ([Note: codes in the
    tiled kernel]) and the others decode each quantized operand to exact bf16 once, then run the
    bf16 kernel. `config` forces a tile config and `predecode` the decode choice: True decodes
    both operands first, False neither."""
    plan = DensePlan(fmt, a, b, bias, out_dtype, config, predecode)
    return plan(a.data, a.scale, a.amax, b.data, b.scale, b.amax, bias)


class DensePlan:
    """The Triton launches of one dense product: the decodes the rule above asks for, then the
    tiled kernel, each worked out once ([Note: product plans]). A call takes the op's tensors
    (data, scale, amax of each side, the bias), which must have the layout the plan was made
    for, and returns the product [M, N] (or [B, M, N] for batched operands)."""

    __slots__ = ("fmt", "m", "n", "k", "batch", "two_d", "out_dtype", "device", "inv",
                 "decode_a", "decode_b", "tiled", "a_fmt", "b_fmt", "config")

    def __init__(self, fmt: str, a: Side, b: Side, bias, out_dtype, config=None, predecode=None):
        from qtensor.kernels import qgemm

        m, n, k = a.data.shape[-2], b.data.shape[-2], reduction_k(fmt, b)
        ka, kb = kernel_operand(fmt, a, qgemm), kernel_operand(fmt, b, qgemm)
        if predecode is None and m <= qgemm.DECODE_FIRST_M:
            dec_a, dec_b = True, False
        elif predecode or (predecode is None and not qgemm.takes_codes(ka, kb, m, n, k)):
            dec_a, dec_b = True, True
        else:
            dec_a, dec_b = False, False
        dec_a, dec_b = dec_a and ka.fmt != qgemm.FMT_HP, dec_b and kb.fmt != qgemm.FMT_HP
        self.fmt, self.m, self.n, self.k, self.out_dtype = fmt, m, n, k, out_dtype
        self.device = b.data.device
        self.decode_a = qgemm.DecodeLaunch(ka, m, k) if dec_a else None
        self.decode_b = qgemm.DecodeLaunch(kb, n, k) if dec_b else None
        self.a_fmt, self.b_fmt = (qgemm.FMT_HP if dec_a else ka.fmt), (qgemm.FMT_HP if dec_b
                                                                       else kb.fmt)
        self.batch = max(ka.batch(), kb.batch())
        self.two_d = a.data.dim() == b.data.dim() == 2
        ep = qgemm.Epilogue(*epilogue_terms(fmt, a, b), bias)
        self.inv = ep.inv
        self.tiled = None  # the persistent kernel's size: qgemm picks per call (TMA or tiled)
        if not isinstance(config, qgemm.TmaConfig) and (
                config is not None or not qgemm.takes_tma(m, n, k)):
            out_shape = (m, n) if self.two_d else None
            a_strides = _decoded_strides(ka, m, k) if dec_a else ka.strides()
            b_strides = _decoded_strides(kb, n, k) if dec_b else kb.strides()
            self.tiled = qgemm.TiledLaunch(
                self.a_fmt, a_strides, self.b_fmt, b_strides, self.batch, ep, device=self.device,
                out_dtype=out_dtype, m=m, n=n, k=k, config=config, out_shape=out_shape)
        self.config = config

    def __call__(self, a_data, a_scale, a_amax, b_data, b_scale, b_amax, bias) -> torch.Tensor:
        if self.fmt != NVFP4:  # MXFP8: the kernels read UE8M0 scale bytes; no amax
            a_scale = a_scale.view(torch.uint8) if a_scale is not None else None
            b_scale = b_scale.view(torch.uint8)
            a_amax = b_amax = None
        if self.decode_a is not None:
            a_data, a_scale = self.decode_a(a_data, a_scale), None
        if self.decode_b is not None:
            b_data, b_scale = self.decode_b(b_data, b_scale), None
        if self.tiled is not None:
            return self.tiled(a_data, a_scale, b_data, b_scale, a_amax, b_amax, bias)
        from qtensor.kernels import qgemm

        out = qgemm.qgemm(qgemm.Operand(self.a_fmt, a_data, a_scale),
                          qgemm.Operand(self.b_fmt, b_data, b_scale),
                          qgemm.Epilogue(a_amax, self.inv, b_amax, bias), out_dtype=self.out_dtype,
                          m=self.m, n=self.n, k=self.k, config=self.config)
        # [1, M, N] -> [M, N] as a tensor of its own (out[0] would be a view).
        return fresh_reshape(out, (self.m, self.n)) if self.two_d else out


def _decoded_strides(side, rows: int, k: int):
    """The (data, scale) strides the GEMM kernel takes for a side decoded first: a fresh bf16
    [B, R, K], whose batch stride is 0 where it holds one matrix (broadcast against a batched
    other side); it has no scale (data's strides stand in, never read)."""
    strides = (rows * k if side.batch() > 1 else 0, k, 1)
    return strides, strides


def triton_grouped_mm(fmt: str, a: Side, b: Side, offs, bias, out_dtype):
    """The tokens are decoded to exact bf16 once, and so are the expert weights unless the
    persistent kernel is set to stream their codes (grouped_qgemm.takes_codes). The kernel
    applies the per-expert epilogue."""
    from qtensor.kernels import grouped_qgemm, qgemm

    t, n, k = a.data.shape[0], b.data.shape[1], reduction_k(fmt, b)
    ka = qgemm.decode_bf16(kernel_operand(fmt, a, qgemm), t, k)
    kb = kernel_operand(fmt, b, qgemm)
    if not grouped_qgemm.takes_codes(ka, kb, out_dtype, t, n, k):
        kb = qgemm.decode_bf16(kb, n, k)
    ep = qgemm.Epilogue(*epilogue_terms(fmt, a, b), bias)
    return grouped_qgemm.grouped_qgemm(ka, kb, offs, ep, out_dtype=out_dtype, t=t, n=n, k=k)


def triton_grouped_mm_k(fmt: str, a: Side, b: Side, offs, out_dtype):
    """[Note: grouped along K]: both operands decoded to exact bf16 once, then one launch for
    every expert's K range with its own epilogue."""
    from qtensor.kernels import grouped_qgemm, qgemm

    m, n, k = a.data.shape[0], b.data.shape[0], reduction_k(fmt, a)
    ka = qgemm.decode_bf16(kernel_operand(fmt, a, qgemm), m, k)
    kb = qgemm.decode_bf16(kernel_operand(fmt, b, qgemm), n, k)
    ep = qgemm.Epilogue(*epilogue_terms(fmt, a, b), None)
    return grouped_qgemm.grouped_qgemm_k(ka, kb, offs, ep, out_dtype=out_dtype, m=m, n=n)


def prepare_dense(fmt: str, a: Side, b: Side, bias, out_dtype, out_shape=None):
    """The CUDA kernel's product as a `qgemm.Prepared` (every argument but a's data bound), or
    None where the kernel would not run it that way: a must be a 2-D high-precision operand of
    at most DECODE_FIRST_M rows and b 2-D. The same launches as `triton_mm`, so the same bits."""
    from qtensor.kernels import qgemm

    if fmt in NO_KERNEL or a.quantized or a.data.dim() != 2 or b.data.dim() != 2:
        return None
    m, n, k = a.data.shape[0], b.data.shape[0], reduction_k(fmt, b)
    if m > qgemm.DECODE_FIRST_M or triton_problem(a, b, bias, out_dtype) or not device_ok(a):
        return None
    check_dense(f"{fmt}_mm", fmt, a, b, bias, out_dtype)
    ep = qgemm.Epilogue(*epilogue_terms(fmt, a, b), bias)
    return qgemm.Prepared(kernel_operand(fmt, a, qgemm), kernel_operand(fmt, b, qgemm), ep,
                          out_dtype=out_dtype, m=m, n=n, k=k, out_shape=out_shape)


# [Note: product plans]
# An eager product's host work is mostly Python that depends only on the layout of its operands:
# the argument checks, the decode rule, the tile config, strides and grid, and the key each
# Triton launch is looked up by. The CUDA kernel of a dense op therefore keeps a `DensePlan` per
# signature of its arguments: for each tensor its shape, strides, dtype, device and 16-byte
# alignment (all the checks read, and all Triton specializes a kernel on besides the values of
# the other arguments), every other argument by value, and whether a CUDA graph is being
# captured (qgemm.takes_codes decodes first then: a replay costs only GPU time). A call whose
# signature was seen skips the checks, which passed for that signature, and runs the plan: its
# allocations and bound launches. Training steps and decode loops repeat a few signatures; the
# table is cleared when it holds PLAN_LIMIT of them. A product the Triton kernels do not run is
# remembered as `_NO_PLAN` and runs the reference. Code that changes the rules' constants
# (tests) calls `clear_plans()` so that the next call plans again.
PLAN_LIMIT = 1024
_PLANS: dict[tuple, object] = {}
_NO_PLAN = object()


def clear_plans() -> None:
    _PLANS.clear()


def planned_mm(fmt: str, args, unpack) -> torch.Tensor | None:
    """The product of a dense op's arguments `args` through the plan of their signature, made
    on the first call from `unpack(args)` (the op's checked (a, b, bias, out_dtype)); None where
    the Triton kernels do not run it."""
    key = _signature(fmt, args)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= PLAN_LIMIT:
            _PLANS.clear()
        plan = _PLANS[key] = _dense_plan(fmt, *unpack(args))
    return None if plan is _NO_PLAN else plan(*_plan_tensors(fmt, args))


def plan_count() -> int:
    return len(_PLANS)


def _signature(fmt: str, args) -> tuple:
    return (fmt, torch.cuda.is_current_stream_capturing(), *[
        (a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15)
        if isinstance(a, torch.Tensor) else a for a in args])


def _dense_plan(fmt: str, a: Side, b: Side, bias, out_dtype):
    if triton_problem(a, b, bias, out_dtype) is None and device_ok(a):
        return DensePlan(fmt, a, b, bias, out_dtype)
    return _NO_PLAN


def _plan_tensors(fmt: str, args) -> tuple:
    """(a data, scale, amax, b data, scale, amax, bias) of a dense op's arguments."""
    if fmt == NVFP4:
        return (*args[:6], args[8])
    return args[0], args[1], None, args[2], args[3], None, args[4]
