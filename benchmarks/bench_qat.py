"""MXFP4 QAT on the GPU: weight conversion vs copy bandwidth, and one training step vs bf16.

    python benchmarks/bench_qat.py [--n 8192] [--k 8192] [--tokens 8192]

Prints, measured side by side in one run (CUDA events, median of 20):
- the device-to-device copy of the bf16 weight (bytes read + written);
- each fused conversion op (projection and direct; MXFP8 rowwise, rowwise + columnwise, FP8
  128x128) and the pure-torch reference of the same conversion, as bytes that must move (weight
  read once, payloads and scales written once) over time, and that bandwidth over the copy's;
- forward + backward of one Linear: bf16 nn.Linear, and MXFP4QATLinear on the FP8 block host
  (cache hit: the weight converted once per optimizer step, as in gradient accumulation).
"""

from __future__ import annotations

import argparse

import torch
from _common import cuda_time_ms
from torch import nn


def conversion_rows(n: int, k: int):
    from qtensor.qat import convert, kernels

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    copy_ms = cuda_time_ms(lambda: w.clone())
    copy_bw = 2 * w.numel() * 2 / copy_ms / 1e6  # GB/s
    rows = [("copy bf16 weight", copy_ms, copy_bw, 1.0)]
    nk = n * k
    cases = [  # name, fn, bytes written besides reading the weight
        ("mxfp8 row", lambda d: kernels.mxfp4_qat_mxfp8(w, d, rowwise=True, columnwise=False),
         nk + nk // 32, lambda d: convert.mxfp8_rowwise(w, d)),
        ("mxfp8 row+col", lambda d: kernels.mxfp4_qat_mxfp8(w, d), 2 * (nk + nk // 32), None),
        ("fp8 128x128", lambda d: kernels.mxfp4_qat_fp8_block(w, d), nk + 4 * nk // 16384,
         lambda d: convert.fp8_block_weight(w, d)),
    ]
    for name, fn, written, ref in cases:
        for direct in (False, True):
            label = f"{name} {'direct' if direct else 'projection'}"
            ms = cuda_time_ms(lambda: fn(direct))
            bw = (2 * nk + written) / ms / 1e6
            rows.append((label, ms, bw, bw / copy_bw))
            if ref is not None:
                rms = cuda_time_ms(lambda: ref(direct), iters=3)
                rbw = (2 * nk + written) / rms / 1e6
                rows.append((label + " (torch reference)", rms, rbw, rbw / copy_bw))
    return rows


def training_rows(n: int, k: int, tokens: int):
    from qtensor.qat import MXFP4QATConfig, quantize_

    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)

    def run(module, **kw):
        xi = x.detach().requires_grad_()
        module(xi, **kw).backward(dy)

    bf16_ms = cuda_time_ms(lambda: run(base))
    rows.append(("Linear fwd+bwd bf16", bf16_ms, float("nan"), 1.0))
    # The default (exact emulated GEMM) and the opt-in native torch._scaled_mm path, which does
    # not match the emulation on the H200 yet (docs/qat.md): timed side by side, labelled.
    for native in (False, True):
        for direct in (False, True):
            qat = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
            quantize_(qat, MXFP4QATConfig(host="fp8_block128", direct=direct, native_gemm=native))
            label = f"Linear fwd+bwd fp8_block128 QAT direct={direct} native_gemm={native}"
            run(qat[0], is_first_microbatch=True)
            ms = cuda_time_ms(lambda: run(qat[0], is_first_microbatch=False))
            rows.append((f"{label} (hit)", ms, float("nan"), bf16_ms / ms))
            ms = cuda_time_ms(lambda: run(qat[0], is_first_microbatch=True))
            rows.append((f"{label} (convert)", ms, float("nan"), bf16_ms / ms))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    from qtensor.backends import qat_quant_backend

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, conversion backend "
          f"{qat_quant_backend('cuda').value}")
    print(f"{'case':76s} {'ms':>9s} {'GB/s':>8s} {'ratio':>7s}")
    print("ratio: conversions over copy bandwidth; training steps bf16 time over this time")
    for name, ms, bw, ratio in conversion_rows(args.n, args.k) + training_rows(
        args.n, args.k, args.tokens
    ):
        print(f"{name:76s} {ms:9.3f} {bw:8.0f} {ratio:7.2f}")


if __name__ == "__main__":
    main()
