"""GPU time alone (CUDA graphs, no host time) of a product on codes ([Note: codes in the tiled
kernel]) against the same product decoded first, at the small GPT's training shapes: what a
compiled step with CUDA graphs pays for each rule.

    python dev/train_probes/codes_gpu_probe.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import capture_graph  # noqa: E402

from qtensor import MXFP8Tensor, NVFP4Tensor  # noqa: E402
from qtensor.gemm.dense import operands, triton_mm  # noqa: E402

SHAPES = ((8192, 512, 512), (8192, 256, 512), (8192, 1408, 512), (8192, 512, 1408),
          (2048, 2048, 2048), (8192, 2048, 512))


def graph_us(fn, calls=20, reps=10):
    g = capture_graph([fn] * calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def main():
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| M x N x K | fmt | bf16 | decoded first | on codes | codes / decoded |")
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bf = graph_us(lambda: x @ w.t())
        for name, cls in (("nvfp4", NVFP4Tensor), ("mxfp8", MXFP8Tensor)):
            a, b = operands(cls.from_hp(x, check_finite=False),
                            cls.from_hp(w, check_finite=False).t())
            dec = graph_us(lambda: triton_mm(a, b, None, torch.bfloat16, predecode=True))
            codes = graph_us(lambda: triton_mm(a, b, None, torch.bfloat16, predecode=False))
            print(f"| {m}x{n}x{k} | {name} | {bf:.1f} | {dec:.1f} | {codes:.1f} | "
                  f"{codes / dec:.2f} |", flush=True)


if __name__ == "__main__":
    main()
