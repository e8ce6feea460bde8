"""The wgrad kernel grouped along K (qtensor/kernels/grouped_qgemm.py, grouped_qgemm_k) against
bf16 torch._grouped_mm's 2-D x 2-D form, at the bench's experts (128 experts, 512 tokens each)
on decoded operands, for several tile configs (BM, BN, BK, warps, stages); GPU us a call, ten
calls back to back.

    python dev/train_probes/grouped_k_probe.py
"""

import torch

from qtensor.kernels import grouped_qgemm, qgemm

CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
           (128, 128, 128, 8, 3), (128, 256, 32, 8, 4), (64, 256, 64, 4, 4)]


def gpu_us(fn, calls=10) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    experts, tokens = 128, 65536
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
    for m, n in ((1536, 2048), (2048, 768)):  # dW of fc1 (gate+up) and fc2
        a = torch.randn(m, tokens, device="cuda").bfloat16()
        b = torch.randn(n, tokens, device="cuda").bfloat16()
        ka, kb = qgemm.Operand(qgemm.FMT_HP, a, None), qgemm.Operand(qgemm.FMT_HP, b, None)
        amax = torch.rand(experts, device="cuda")
        ep = qgemm.Epilogue(amax, 0.5, amax, None)
        bf16 = gpu_us(lambda: torch._grouped_mm(a, b.t(), offs))
        print(f"M{m} N{n}: bf16 _grouped_mm 2d-2d {bf16:.0f} us", flush=True)
        for cfg in CONFIGS:
            us = gpu_us(lambda: grouped_qgemm.grouped_qgemm_k(
                ka, kb, offs, ep, out_dtype=torch.bfloat16, m=m, n=n, config=cfg))
            print(f"  {cfg}: {us:.0f} us ({bf16 / us:.2f}x bf16)", flush=True)


if __name__ == "__main__":
    main()
