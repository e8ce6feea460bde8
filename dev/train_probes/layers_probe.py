"""A training linear's host time layer by layer on the GPU: each call that fprop and the input's
cast make, timed alone (host microseconds a call, issued 200 times, synchronized once), and the
RHT amax in the main thread against the autograd engine's backward thread.

At 256 tokens, 512 -> 1408 (host_probe.py's shape), NVFP4 default recipe.

    python dev/train_probes/layers_probe.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from host_probe import host_us  # noqa: E402
from bench_training import RECIPES  # noqa: E402

from qtensor.gemm import dense  # noqa: E402
from qtensor.ops import gemm_ops, gemm_triton, quant  # noqa: E402
from qtensor.tensors import HybridTensor, NVFP4Tensor  # noqa: E402
from qtensor.training import NVFP4TrainingRecipe, TrainingLinear  # noqa: E402
from qtensor.training.linear import quantize_weight  # noqa: E402
from qtensor.training.roles import fprop, quantize_role, quantize_rowwise, sr_for_role  # noqa

TOKENS, K, N = 256, 512, 1408


class InBackward(torch.autograd.Function):
    """Runs `fn` `calls` times inside the backward (the engine's device thread), timed there."""
    seen = []

    @staticmethod
    def forward(ctx, x, fn, calls):
        ctx.fn, ctx.calls = fn, calls
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(ctx.calls):
            ctx.fn()
        torch.cuda.synchronize()
        InBackward.seen.append((time.perf_counter() - t) / ctx.calls * 1e6)
        return g, None, None


def backward_us(fn, calls=200, reps=5):
    InBackward.seen.clear()
    x = torch.zeros(4, device="cuda", requires_grad=True)
    for _ in range(reps + 1):
        InBackward.apply(x, fn, calls).sum().backward()
    return statistics.median(InBackward.seen[1:])


def main():
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; host us a call "
          f"at {TOKENS} tokens, {K} -> {N}")
    torch.manual_seed(0)
    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, N, device="cuda", dtype=torch.bfloat16)
    mod = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RECIPES["nvfp4"]), **kw)
    specs, sr = mod.state.specs, mod.sr_state.clone()
    x_op = quantize_role(x2, specs.input, "input", sr_for_role("input", specs.input, sr))
    w_op = quantize_weight(mod.weight.detach(), specs)
    rows = {}
    rows["fprop"] = host_us(lambda: fprop(x_op, w_op, None, torch.bfloat16))
    a_op = dense._side(x_op, "left")
    b_op = dense._transposed_part(w_op, "right")
    rows["fprop: _side + _transposed_part"] = host_us(
        lambda: (dense._side(x_op, "left"), dense._transposed_part(w_op, "right")))
    rows["fprop: _check_pair"] = host_us(lambda: dense._check_pair(a_op, b_op))
    rows["fprop: _format"] = host_us(lambda: dense._format(a_op, b_op))
    rows["fprop: two _rows_side"] = host_us(
        lambda: (dense._rows_side(a_op, True), dense._rows_side(b_op, True)))
    fmt = dense._format(a_op, b_op)
    sides = (fmt, dense._rows_side(a_op, True), dense._rows_side(b_op, True), ())
    rows["fprop: plan"] = host_us(lambda: dense.plan(a_op, b_op, None, torch.bfloat16, sides))
    rows["fprop: triton_problem"] = host_us(
        lambda: gemm_triton.triton_problem(sides[1], sides[2], None, torch.bfloat16))
    rows["fprop: dense_args"] = host_us(
        lambda: gemm_ops.dense_args(fmt, sides[1], sides[2], None, torch.bfloat16))
    args = gemm_ops.dense_args(fmt, sides[1], sides[2], None, torch.bfloat16)
    rows["fprop: _direct_ok"] = host_us(
        lambda: gemm_ops._direct_ok(a for a in args if isinstance(a, torch.Tensor)))
    rows["fprop: gemm_ops.call"] = host_us(lambda: gemm_ops.call(f"{fmt}_mm", *args))
    rows["fprop: the op through the dispatcher"] = host_us(lambda: gemm_ops.op(f"{fmt}_mm")(*args))
    rows["fprop: the op's CUDA function"] = host_us(
        lambda: gemm_ops.KERNELS[f"{fmt}_mm"]["cuda"](*args))
    rows["fprop: _run_dense"] = host_us(
        lambda: dense._run_dense(*sides[:3], None, torch.bfloat16, (), dense.GemmBackend.TRITON))

    role = specs.input
    srs = sr_for_role("input", role, sr)
    rows["input cast (both usages)"] = host_us(lambda: quantize_role(x2, role, "input", srs))
    rows["input: sr_for_role"] = host_us(lambda: sr_for_role("input", role, sr))
    rows["input: quantize_rowwise"] = host_us(lambda: quantize_rowwise(x2, role, "input", srs[0]))
    rows["input: NVFP4Tensor.from_spec rowwise"] = host_us(
        lambda: NVFP4Tensor.from_spec(x2, role.rowwise, generator=srs[0], check_finite=False))
    rows["input: NVFP4Tensor.from_spec columnwise"] = host_us(
        lambda: NVFP4Tensor.from_spec(x2, role.columnwise, generator=srs[1], check_finite=False))
    rows["input: quant.quantize_nvfp4 columnwise"] = host_us(
        lambda: quant.quantize_nvfp4(x2, role.columnwise, srs[1]))
    data, backend = quant.quantize_nvfp4(x2, role.columnwise, srs[1])
    rows["input: NVFP4Tensor.wrap"] = host_us(
        lambda: NVFP4Tensor.wrap(x2, role.columnwise, data, backend))
    row, col = x_op.rowwise, x_op.columnwise
    rows["input: HybridTensor()"] = host_us(
        lambda: HybridTensor(x2.shape, x2.dtype, x2.device, rowwise=row, columnwise=col,
                             columnwise_source=role.columnwise_source))
    a_rht = quant.amax(x2, columnwise=True, rht=True)
    for name, fn in (
        ("amax plain", lambda: quant.amax(x2)),
        ("amax columnwise RHT", lambda: quant.amax(x2, columnwise=True, rht=True)),
        ("amax columnwise RHT on dY", lambda: quant.amax(dy, columnwise=True, rht=True)),
        ("nvfp4 codes rowwise", lambda: quant.nvfp4_codes(x2, data.amax, role.rowwise, srs[0])),
        ("nvfp4 codes columnwise RHT SR",
         lambda: quant.nvfp4_codes(x2, a_rht, role.columnwise, srs[1])),
        ("torch.empty [256, 1408] bf16",
         lambda: torch.empty((TOKENS, N), dtype=torch.bfloat16, device="cuda")),
        ("x2.clone()", lambda: x2.clone()),
    ):
        rows[name] = host_us(fn)
        rows[name + ", in the backward thread"] = backward_us(fn)
    for piece, us in rows.items():
        print(f"| {piece} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
