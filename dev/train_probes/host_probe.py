"""Where a training linear's host time goes on the GPU, piece by piece.

At 256 tokens, 512 -> 1408 (the small GPT's MLP width; more than 64 rows, so the products take
the same kernels as at 8192 tokens, but the GPU's work is far shorter than the host's), host
microseconds a call of each piece of an NVFP4 TrainingLinear step, issued 200 times and
synchronized once (the figure is the host's issue rate): the roles' casts, the three products,
the whole step, and below them the layers of one product (the op's kernel called directly, the
Triton kernel with prepared operands, a bare launch, an allocation).

With --step: the NVFP4 step's host time split (forward alone, forward and backward on a
cached weight, the weight's cast with and without autograd recording), then the torch profiler's
ops by self CPU time and a cProfile of the step.

    python dev/train_probes/host_probe.py [--step] [recipe ...]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_overhead import profile as cprofile  # noqa: E402
from bench_training import RECIPES, update_step  # noqa: E402

from qtensor.gemm.dense import dense_sides, operands  # noqa: E402
from qtensor.ops import gemm_ops, gemm_triton  # noqa: E402
from qtensor.ops.gemm_operands import epilogue_terms, reduction_k  # noqa: E402
from qtensor.training import NVFP4TrainingRecipe, TrainingLinear  # noqa: E402
from qtensor.training.linear import quantize_weight  # noqa: E402
from qtensor.training.roles import (dgrad, fprop, quantize_role, sr_for_role,  # noqa: E402
                                    wgrad)

TOKENS, K, N = 256, 512, 1408


def host_us(fn, calls=200, reps=5):
    """Median host us a call of `calls` calls issued back to back and synchronized once."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for rep in range(reps + 1):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        if rep:
            times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def pieces(name):
    torch.manual_seed(0)
    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, N, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(K, N, **kw)
    mod = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RECIPES[name]), **kw)
    rows = {"bf16 nn.Linear step": host_us(update_step(lin, lambda m: m(x), dy)),
            "TrainingLinear step": host_us(update_step(mod, lambda m: m(x), dy))}
    specs, x2 = mod.state.specs, x.detach()
    sr = mod.sr_state.clone()
    rows["quantize input (both usages)"] = host_us(
        lambda: quantize_role(x2, specs.input, "input", sr_for_role("input", specs.input, sr)))
    rows["quantize weight (both usages)"] = host_us(
        lambda: quantize_weight(mod.weight.detach(), specs))
    rows["quantize grad_output (both usages)"] = host_us(
        lambda: quantize_role(dy, specs.grad_output, "grad_output",
                              sr_for_role("grad_output", specs.grad_output, sr)))
    x_op = quantize_role(x2, specs.input, "input", sr_for_role("input", specs.input, sr))
    w_op = quantize_weight(mod.weight.detach(), specs)  # as the weight cache casts it
    dy_op = quantize_role(dy, specs.grad_output, "grad_output",
                          sr_for_role("grad_output", specs.grad_output, sr))
    rows["fprop"] = host_us(lambda: fprop(x_op, w_op, None, torch.bfloat16))
    rows["dgrad"] = host_us(lambda: dgrad(dy_op, w_op, torch.bfloat16))
    rows["wgrad"] = host_us(lambda: wgrad(dy_op, x_op, torch.bfloat16))
    # One product's layers: the op's CUDA kernel function, triton_mm, qgemm, a launch.
    from qtensor.kernels import qgemm  # Triton: imported where the GPU pieces run
    a, b = operands(x_op.rowwise, w_op.rowwise.t())
    fmt, sa, sb, _ = dense_sides(a, b)
    args = gemm_ops.dense_args(fmt, sa, sb, None, torch.bfloat16)
    cuda_fn = gemm_ops.KERNELS[f"{fmt}_mm"]["cuda"]
    rows["fprop: the op's CUDA function"] = host_us(lambda: cuda_fn(*args))
    rows["fprop: triton_mm"] = host_us(lambda: gemm_triton.triton_mm(fmt, sa, sb, None,
                                                                  torch.bfloat16))
    ka, kb = gemm_triton.kernel_operand(fmt, sa, qgemm), gemm_triton.kernel_operand(fmt, sb, qgemm)
    m, n, k = sa.data.shape[-2], sb.data.shape[-2], reduction_k(fmt, sb)
    ep = qgemm.Epilogue(*epilogue_terms(fmt, sa, sb), None)
    rows["fprop: qgemm on codes"] = host_us(
        lambda: qgemm.qgemm(ka, kb, ep, out_dtype=torch.bfloat16, m=m, n=n, k=k))
    rows["decode_bf16 of the input"] = host_us(lambda: qgemm.decode_bf16(ka, m, k))
    rows["torch.empty [256, 1408] bf16"] = host_us(
        lambda: torch.empty((1, m, n), dtype=torch.bfloat16, device="cuda"))
    rows["amax op"] = host_us(lambda: torch.ops.qtensor.amax.default(x2, False, False, False))
    return rows


def step_split(name="nvfp4", steps=20):
    torch.manual_seed(0)
    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, N, device="cuda", dtype=torch.bfloat16)
    mod = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RECIPES[name]), **kw)
    step = update_step(mod, lambda m: m(x), dy)
    rows = {"step (forward, backward, update)": host_us(step),
            "forward, weight cached": host_us(lambda: mod(x)),
            "forward + backward, weight cached": host_us(lambda: mod(x).backward(dy))}
    specs = mod.state.specs
    rows["weight cast, grad enabled"] = host_us(lambda: quantize_weight(mod.weight, specs))
    with torch.no_grad():
        rows["weight cast, no_grad"] = host_us(lambda: quantize_weight(mod.weight, specs))
    w_op = quantize_weight(mod.weight, specs)
    rows["weight operand's amax requires grad"] = float(w_op.rowwise.amax.requires_grad)
    for piece, us in rows.items():
        print(f"| {name} | {piece} | {us:.1f} |", flush=True)
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    cprofile(step, calls=steps, top=35)


def main():
    if "--step" in sys.argv:
        step_split()
        return
    recipes = sys.argv[1:] or ["nvfp4", "4over6"]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; host us a call "
          f"at {TOKENS} tokens, {K} -> {N}")
    for name in recipes:
        for piece, us in pieces(name).items():
            print(f"| {name} | {piece} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
