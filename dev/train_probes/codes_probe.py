"""Products of more than 64 rows on the operands' codes ([Note: codes in the tiled kernel])
against decoding each operand first, at the small GPT's training shapes and a few larger ones,
then the small GPT's eager step with each rule and the persistent kernels' direct launch.

Per shape and format (NVFP4 x NVFP4, MXFP8 x MXFP8), us a call: bf16 `a @ b.t()` (cuBLAS), the
product decoded first (two decode passes and the bf16 kernel), and the tiled kernel on codes at
each tile config of CFGS; GPU time of ten calls back to back, and the host's time to issue one
call (20 calls issued, no wait: the queue does not fill). `err` is the largest difference of
the fp32 results of the codes run and the decoded run over the largest magnitude (the sums'
order only).

    python dev/train_probes/codes_probe.py [--gpt] [--gpt-only]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_training import back_to_back_us, gpt_step, step_ms  # noqa: E402

from qtensor import MXFP8Tensor, NVFP4Tensor  # noqa: E402
from qtensor.gemm.dense import operands, quantized_mm, triton_mm  # noqa: E402
from qtensor.kernels import grouped_qgemm, qgemm  # noqa: E402

SHAPES = (  # (M, N, K): the small GPT's fprop, dgrad and wgrad products, then larger ones
    (8192, 512, 512), (8192, 256, 512), (8192, 1408, 512), (8192, 512, 1408),
    (512, 512, 8192), (1408, 512, 8192), (512, 1408, 8192), (256, 512, 8192),
    (2048, 2048, 2048), (4096, 4096, 1024), (8192, 2048, 512), (4096, 4096, 4096),
)
CFGS = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 64, 4, 3),
        (128, 128, 64, 8, 4), (64, 128, 64, 4, 3))


def issue_us(fn, calls=20, reps=5):
    """Host microseconds to issue one call (no wait; the launch queue stays short)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def products():
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| M x N x K | fmt | bf16 | decoded first (host) | codes: " +
          " | ".join(str(c) for c in CFGS) + " | codes host | err |")
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bf = back_to_back_us(lambda: x @ w.t(), 3, 10)
        for name, cls in (("nvfp4", NVFP4Tensor), ("mxfp8", MXFP8Tensor)):
            a_op, b_op = operands(cls.from_hp(x, check_finite=False),
                                  cls.from_hp(w, check_finite=False).t())
            dec = back_to_back_us(lambda: triton_mm(a_op, b_op, None, torch.bfloat16,
                                                    predecode=True), 3, 10)
            dec_host = issue_us(lambda: triton_mm(a_op, b_op, None, torch.bfloat16,
                                                  predecode=True))
            ref = triton_mm(a_op, b_op, None, torch.float32, predecode=True)
            cells, errs = [], []
            for c in CFGS:
                cfg = qgemm.Config(c[0], c[1], c[2], 1, c[3], c[4])
                try:
                    us = back_to_back_us(lambda: triton_mm(a_op, b_op, None, torch.bfloat16,
                                                           config=cfg, predecode=False), 3, 10)
                    got = triton_mm(a_op, b_op, None, torch.float32, config=cfg, predecode=False)
                    errs.append(((got - ref).abs().max() / ref.abs().max()).item())
                    cells.append(f"{us:.0f} ({dec / us:.2f})")
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    cells.append(f"{type(e).__name__}")
            host = issue_us(lambda: triton_mm(a_op, b_op, None, torch.bfloat16, predecode=False))
            print(f"| {m}x{n}x{k} | {name} | {bf:.0f} | {dec:.0f} ({dec_host:.0f}) | " +
                  " | ".join(cells) + f" | {host:.0f} | {max(errs, default=float('nan')):.1e} |",
                  flush=True)
        torch.cuda.empty_cache()


def persistent_launch():
    """Host us to issue a persistent kernel's product (its TMA descriptors keyed by the direct
    launcher) and GPU us back to back: 4096^3 NVFP4 dense, and the 8-expert grouped product."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a, b = NVFP4Tensor.from_hp(x, check_finite=False), NVFP4Tensor.from_hp(x, check_finite=False)
    bf = back_to_back_us(lambda: x @ x.t(), 3, 10)
    fn = lambda: quantized_mm(a, b.t())  # noqa: E731
    print(f"4096^3 NVFP4: bf16 {bf:.0f} us; qtensor {back_to_back_us(fn, 3, 10):.0f} us GPU back "
          f"to back, {issue_us(fn):.0f} us host a call; "
          f"TMA launcher keys {len(qgemm._TMA_GEMM.cache)}, direct {qgemm._TMA_GEMM.direct}")
    experts, tokens, k, n = 8, 8192, 2048, 1536
    xt = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
    bf = back_to_back_us(lambda: torch._grouped_mm(xt, wt.transpose(-1, -2), offs=offs), 3, 10)
    qa = NVFP4Tensor.from_hp(xt, check_finite=False)
    qw = NVFP4Tensor.from_hp(wt, check_finite=False).transpose(-1, -2)
    for limit in (grouped_qgemm.TMA_MIN_MNK, 0):
        grouped_qgemm.TMA_MIN_MNK = limit
        fn = lambda: torch._grouped_mm(qa, qw, offs)  # noqa: E731
        print(f"grouped E=8 {tokens}x{n}x{k} NVFP4, persistent from {limit} multiply-adds: "
              f"bf16 {bf:.0f} us; GPU {back_to_back_us(fn, 3, 10):.0f} us back to back, "
              f"{issue_us(fn):.0f} us host a call; grouped TMA keys "
              f"{len(grouped_qgemm._GROUPED_TMA.cache)}", flush=True)


def gpt(recipes=("nvfp4",)):
    """The small GPT's eager step (ms) with codes in the kernel and with every operand decoded
    first, alternating, two passes."""
    default = qgemm.CODES_MAX_MNK
    steps = {name: gpt_step(name) for name in ("bf16", *recipes)}
    for rep in range(2):
        for name, step in steps.items():
            for limit in ((default, 0) if name != "bf16" else (default,)):
                qgemm.CODES_MAX_MNK = limit
                ms = step_ms(step, 3, 10)
                print(f"gpt pass {rep} {name:10s} codes below {limit}:"
                      f" {ms:.2f} ms", flush=True)
    qgemm.CODES_MAX_MNK = default


if __name__ == "__main__":
    if "--gpt-only" not in sys.argv:
        persistent_launch()
        products()
    if "--gpt" in sys.argv or "--gpt-only" in sys.argv:
        gpt()
