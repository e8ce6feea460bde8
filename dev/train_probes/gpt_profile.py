"""Where the small GPT's quantized step spends its time (bench_training.py's gpt section), and
the MoE step's (its moe section), on the GPU.

For bf16 and each named recipe: the eager step's time, the compiled step's (default mode and
mode="reduce-overhead"), dynamo's counters (graphs, graph breaks, recompiles), and from
torch.profiler over `--steps` steps: kernels and host calls a step, the GPU's busy time a step,
the top kernels by GPU time and the top host ops by self CPU time. A cProfile of the eager step
gives the Python functions that take the host's time.

    python dev/train_probes/gpt_profile.py OUTDIR [--recipes nvfp4] [--moe]
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_training import gpt_step  # noqa: E402


def timed(step, warmup=3, iters=10):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    times.sort()
    return times[len(times) // 2]


def profile(step, steps, out: Path, tag: str):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    kernels = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
    n_kernels = sum(e.count for e in kernels) / steps
    gpu_us = sum(e.self_device_time_total for e in kernels) / steps
    calls = {e.key: e.count / steps for e in ka
             if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaLaunchKernelExC", "cudaStreamSynchronize", "cudaMemcpyAsync",
                          "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
                          "aten::_local_scalar_dense")}
    print(f"{tag}: {n_kernels:.0f} GPU ops a step, GPU busy {gpu_us / 1e3:.2f} ms a step; "
          f"host calls a step {calls}", flush=True)
    (out / f"{tag}_kernels.txt").write_text(
        ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
    (out / f"{tag}_cpu.txt").write_text(
        ka.table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=90))


def python_profile(step, out: Path, tag: str, steps=3):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    (out / f"{tag}_cprofile.txt").write_text(s.getvalue())


def dynamo_counters():
    from torch._dynamo.utils import counters
    return {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}


def moe(out: Path, recipe_name):
    sys.argv = sys.argv[:1]
    import bench_training as bt

    holder = {}
    orig = bt.step_ms

    def grab(step, warmup, iters):
        holder["step"] = step
        return orig(step, warmup, iters)
    bt.step_ms = grab
    bt.moe_section([recipe_name], 1, 3)
    bt.step_ms = orig
    step = holder["step"]
    profile(step, 1, out, f"moe_{recipe_name}")
    python_profile(step, out, f"moe_{recipe_name}", steps=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--recipes", default="nvfp4")
    p.add_argument("--modes", default="eager,default,reduce-overhead")
    p.add_argument("--moe", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ["bf16", *a.recipes.split(",")]:
        for mode in a.modes.split(","):
            tag = f"gpt_{name}_{mode}"
            try:
                step = gpt_step(name, mode)
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                ms = timed(step)
                print(f"{tag}: {ms:.2f} ms a step (first step {first:.1f} s) "
                      f"{dynamo_counters() if mode != 'eager' else ''}", flush=True)
                profile(step, a.steps, out, tag)
                if mode == "eager" and name != "bf16":
                    python_profile(step, out, tag)
            except Exception as e:  # noqa: BLE001 - reported, the next mode still runs
                print(f"{tag}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            torch.cuda.empty_cache()
    if a.moe:
        for name in a.recipes.split(","):
            moe(out, name)


if __name__ == "__main__":
    main()
