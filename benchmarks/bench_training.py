"""Backward cost per linear and step: quantize(dY) + dgrad + wgrad, side by side (seed 000).

Configurations (the RL forward settings: no RHT / stochastic rounding / 2D):
  bf16         dX = dY W and dW = dY^T X with torch.mm in bf16 (cuBLAS)
  mxfp8        MXFP8 dY (both usages), MXFP8 dgrad and wgrad
  nvfp4        NVFP4 dY (both usages), NVFP4 dgrad and wgrad
  dgrad_mxfp8  hybrid dY (MXFP8 rowwise + NVFP4 columnwise), MXFP8 dgrad, NVFP4 wgrad
The X columnwise operand (quantized in the forward) and the W columnwise operand (once per
optimizer step) are built before timing and reported apart (quant_w_ms). Every quantized
operand goes through the recipe's role pieces and the GEMM layer (qtensor.gemm.dense), so the
numbers are those of whatever GEMM backend the tensors resolved (printed per row). A second
table times forward + backward of a whole TrainingLinear against nn.Linear in bf16.

Timing: CUDA events around each piece, median of --iters after --warmup calls, warm L2.
Run on the GPU machine: python benchmarks/bench_training.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import RL_FORWARD as RL
from _common import cuda_time_ms, mxfp8_backward_specs

from qtensor.training import NVFP4TrainingRecipe, TrainingLinear
from qtensor.training.roles import dgrad, quantize_role, wgrad

SHAPES = {  # name: (tokens, in_features, out_features)
    "qwen3-8b gate_up": (16384, 4096, 24576),
    "qwen3-8b down": (16384, 12288, 4096),
    "deepseek-v3 expert fc1": (8192, 7168, 4096),
    "deepseek-v3 expert fc2": (8192, 2048, 7168),
    "qwen3-30b-a3b expert fc1": (8192, 2048, 1536),
    "qwen3-30b-a3b expert fc2": (8192, 768, 2048),
}


SPECS = {
    "mxfp8": mxfp8_backward_specs(NVFP4TrainingRecipe(**RL)),
    "nvfp4": NVFP4TrainingRecipe(**RL).operand_specs(),
    "dgrad_mxfp8": NVFP4TrainingRecipe(dgrad_mxfp8=True, **RL).operand_specs(),
}


def backward_times(x, w, dy, warmup, iters) -> dict:
    bf = torch.bfloat16
    res = {"bf16": {"dgrad_ms": cuda_time_ms(lambda: dy @ w, warmup, iters),
                    "wgrad_ms": cuda_time_ms(lambda: dy.t() @ x, warmup, iters)}}
    for name, specs in SPECS.items():
        x_op = quantize_role(x, specs.input, "input")
        w_op = quantize_role(w, specs.weight, "weight")
        dy_op = quantize_role(dy, specs.grad_output, "grad_output")
        res[name] = {
            "quant_dy_ms": cuda_time_ms(
                lambda: quantize_role(dy, specs.grad_output, "grad_output"), warmup, iters),
            "quant_w_ms": cuda_time_ms(lambda: quantize_role(w, specs.weight, "weight"),
                                       warmup, iters),
            "dgrad_ms": cuda_time_ms(lambda: dgrad(dy_op, w_op, bf), warmup, iters),
            "wgrad_ms": cuda_time_ms(lambda: wgrad(dy_op, x_op, bf), warmup, iters),
            "backend": getattr(getattr(w_op, "rowwise", w_op), "gemm_backend", "?"),
        }
    for r in res.values():
        r["bwd_ms"] = r.get("quant_dy_ms", 0.0) + r["dgrad_ms"] + r["wgrad_ms"]
    return res


def linear_times(t, k, n, warmup, iters) -> dict:
    x = (torch.randn(t, k, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    dy = (torch.randn(t, n, device="cuda") * 1e-3).to(torch.bfloat16)
    out = {}
    mods = {"bf16": torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)}
    for name, kw in (("nvfp4", {}), ("dgrad_mxfp8", {"dgrad_mxfp8": True})):
        mods[name] = TrainingLinear(k, n, bias=False, recipe=NVFP4TrainingRecipe(**RL, **kw),
                                    device="cuda", dtype=torch.bfloat16)
    for name, mod in mods.items():
        out[name] = cuda_time_ms(lambda: mod(x).backward(dy), warmup, iters)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(f"device {dev}, torch {torch.__version__}")
    print(f"{'shape (tokens, in, out)':42s} {'bf16':>8s} {'mxfp8':>8s} {'nvfp4':>8s} "
          f"{'dgrad_mxfp8':>11s} {'dgmx/bf16':>9s}  backend")
    results = {"device": dev, "backward": {}, "linear_fwd_bwd": {}}
    for name in args.shapes.split(","):
        t, k, n = SHAPES[name]
        x = (torch.randn(t, k, device="cuda") * 0.5).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        dy = (torch.randn(t, n, device="cuda") * 1e-3).to(torch.bfloat16)
        r = backward_times(x, w, dy, args.warmup, args.iters)
        results["backward"][name] = r
        b = {c: r[c]["bwd_ms"] for c in r}
        print(f"{name + ' ' + str((t, k, n)):42s} {b['bf16']:8.3f} {b['mxfp8']:8.3f} "
              f"{b['nvfp4']:8.3f} {b['dgrad_mxfp8']:11.3f} {b['dgrad_mxfp8'] / b['bf16']:9.2f}"
              f"  {r['nvfp4']['backend']}", flush=True)
        del x, w, dy
        lt = linear_times(t, k, n, args.warmup, args.iters)
        results["linear_fwd_bwd"][name] = lt
        print(f"{'  Linear fwd+bwd (ms)':42s} {lt['bf16']:8.3f} {'':>8s} {lt['nvfp4']:8.3f} "
              f"{lt['dgrad_mxfp8']:11.3f} {lt['dgrad_mxfp8'] / lt['bf16']:9.2f}", flush=True)
        torch.cuda.empty_cache()
    large = [n for n in results["backward"] if not n.startswith("qwen3-30b")]
    bwd = results["backward"]
    ratios = [bwd[n]["dgrad_mxfp8"]["bwd_ms"] / bwd[n]["bf16"]["bwd_ms"] for n in large]
    if ratios:
        print(f"dgrad_mxfp8 backward / bf16 at the large shapes: max {max(ratios):.2f}x "
              f"(goal <= 1.25x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
