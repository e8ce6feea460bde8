"""Host syncs in the small GPT's eager training step, per recipe (bench_training.py's gpt).

A sync inside a step makes the host wait for the GPU, so the step costs host time plus GPU time
rather than the larger of the two. torch.cuda.set_sync_debug_mode("warn") warns at each
synchronizing call; this counts the warnings of one step after warm-up and prints where each
distinct one came from.

    python dev/train_probes/sync_probe.py [recipe ...]
"""
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_training import RECIPES, gpt_step  # noqa: E402


def main(names):
    for name in names:
        step = gpt_step(name)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        sites = Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            stack = [f for f in traceback.extract_stack()[:-1]
                     if "warnings" not in f.filename and "sync_probe" not in f.filename]
            ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack
                    if "qtensor" in f.filename or "bench_training" in f.filename]
            sites[(str(message)[:80], " <- ".join(reversed(ours[-4:])))] += 1

        old = warnings.showwarning
        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
        torch.cuda.synchronize()
        print(f"{name}: {sum(sites.values())} synchronizing calls in one step", flush=True)
        for (msg, where), n in sites.most_common(12):
            print(f"  {n:4d}  {msg}  at {where}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16", *RECIPES])
