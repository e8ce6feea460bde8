"""Whether a training linear's backward costs more in another thread than in the calling one,
and whether that thread's core is the cause; on the CPU, where autograd runs the backward in the
calling thread, so a worker thread stands in for the engine's device thread.

A worker thread waits on a queue, as the engine's device thread does: the main thread runs the
forward, hands the output over, and waits until the worker has run the backward. Host
microseconds a step (the fastest of 9 rounds of 200 steps, the cases taking turns), three
ways: forward and backward in the main thread, the backward handed to the worker, and the bare
hand-over (the worker runs nothing). With `--core N` the whole process, the worker included, is
pinned to core N, so both threads share one core's caches.

    python dev/train_probes/thread_probe.py [--core N] [recipe | bf16]
"""
import argparse
import os
import queue
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_training import RECIPES  # noqa: E402

from qtensor.training import NVFP4TrainingRecipe, TrainingLinear  # noqa: E402


def per_step_us(fns: dict, steps=200, rounds=9, warmup=30) -> dict:
    """{name: the fastest round's us a step}; the cases take turns within each round, so a
    busy spell of a shared machine falls on all of them."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t) / steps * 1e6)
    return {name: min(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", default="nvfp4", choices=["bf16", *sorted(RECIPES)],
                    help="a recipe of bench_training, or bf16 for a plain nn.Linear")
    ap.add_argument("--core", type=int, default=None, help="pin the process to this core")
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})  # threads started later inherit it
    torch.set_num_threads(1)  # the kernels' own threads would blur the two cases
    torch.manual_seed(0)
    kw = dict(bias=False, dtype=torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 64, dtype=torch.bfloat16)
    mod = torch.nn.Linear(64, 64, **kw) if args.recipe == "bf16" else TrainingLinear(
        64, 64, recipe=NVFP4TrainingRecipe(**RECIPES[args.recipe]), **kw)
    jobs, done = queue.Queue(), queue.Queue()

    def worker():
        while (y := jobs.get()) is not None:
            if isinstance(y, torch.Tensor):
                y.backward(dy)
            done.put(True)

    threading.Thread(target=worker, daemon=True).start()

    def main_thread():
        mod(x).backward(dy)

    def worker_thread():
        jobs.put(mod(x))
        done.get()

    def hand_over():
        jobs.put(0)
        done.get()

    print(f"{args.recipe}, 64 x 64 x 64, cores {sorted(os.sched_getaffinity(0))}; host us a "
          "step, the fastest of 9 rounds")
    us = per_step_us({"backward in the main thread": main_thread,
                      "backward in the worker": worker_thread, "bare hand-over": hand_over})
    for name, t in us.items():
        print(f"| {name} | {t:.0f} |")
    extra = us["backward in the worker"] - us["backward in the main thread"] - us["bare hand-over"]
    print(f"| the worker's thread beyond the hand-over | {extra:.0f} |")
    jobs.put(None)


if __name__ == "__main__":
    main()
