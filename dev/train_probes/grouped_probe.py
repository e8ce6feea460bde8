"""The grouped GEMM's parts on the GPU: the persistent TMA kernel ([Note: persistent grouped
GEMM]) against the tiled one and bf16 `torch._grouped_mm`, the decode passes alone, and a sweep
of the persistent kernel's tile configs, at the MoE shapes of bench_training.py's gemm section
and the Qwen3-30B-A3B expert shapes (fc1 2048 -> 1536, fc2 768 -> 2048, 128 experts).

    python dev/train_probes/grouped_probe.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_training import back_to_back_us  # noqa: E402

from qtensor import MXFP8Tensor, NVFP4Tensor  # noqa: E402
from qtensor.gemm.grouped import grouped_mm  # noqa: E402
from qtensor.kernels import grouped_qgemm, qgemm  # noqa: E402

SHAPES = ((8, 8192, 2048, 1536), (128, 65536, 2048, 1536), (128, 65536, 768, 2048))
CONFIGS = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
           (256, 128, 64, 8, 3), (128, 256, 128, 8, 2))


def main(warmup=3, iters=10):
    for experts, tokens, k, n in SHAPES:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
        bf16 = back_to_back_us(lambda: torch._grouped_mm(x, w.transpose(-1, -2), offs=offs),
                               warmup, iters)
        row = f"| E={experts} {tokens}x{n}x{k} | {bf16:.0f} |"
        for cls in (NVFP4Tensor, MXFP8Tensor):
            qa = cls.from_hp(x, check_finite=False)
            qw = cls.from_hp(w, check_finite=False).transpose(-1, -2)
            ref = grouped_mm(qa, qw, offs).float()
            for kernel in ("persistent", "tiled"):
                orig = grouped_qgemm.tma_problem
                if kernel == "tiled":
                    grouped_qgemm.tma_problem = lambda *a: "probe"
                try:
                    us = back_to_back_us(lambda: grouped_mm(qa, qw, offs), warmup, iters)
                    out = grouped_mm(qa, qw, offs).float()
                finally:
                    grouped_qgemm.tma_problem = orig
                err = ((out - ref).norm() / ref.norm()).item()
                row += f" {us:.0f} ({bf16 / us:.2f}x, err {err:.1e}) |"
        print(row, flush=True)
        # the decode passes alone, and the persistent kernel's configs on decoded operands
        qa, qw = NVFP4Tensor.from_hp(x, check_finite=False), NVFP4Tensor.from_hp(w, check_finite=False)
        ka = qgemm.Operand(qgemm.FMT_NVFP4, qa.qdata, qa.scale)
        kw = qgemm.Operand(qgemm.FMT_NVFP4, qw.qdata, qw.scale)
        dec_a = back_to_back_us(lambda: qgemm.decode_bf16(ka, tokens, k), warmup, iters)
        dec_w = back_to_back_us(lambda: qgemm.decode_bf16(kw, n, k), warmup, iters)
        da, dw = qgemm.decode_bf16(ka, tokens, k), qgemm.decode_bf16(kw, n, k)
        ep = qgemm.Epilogue(None, None, None, None)
        sweep = []
        for cfg in CONFIGS:
            c = qgemm.TmaConfig(*cfg, False)
            try:
                us = back_to_back_us(lambda: grouped_qgemm.grouped_qgemm(
                    da, dw, offs, ep, out_dtype=torch.bfloat16, t=tokens, n=n, k=k, config=c),
                    warmup, iters)
                sweep.append(f"{cfg}: {us:.0f} ({bf16 / us:.2f}x)")
            except Exception as e:  # noqa: BLE001 - a config that does not fit is reported
                sweep.append(f"{cfg}: {type(e).__name__} {str(e)[:80]}")
        tiled = back_to_back_us(lambda: grouped_qgemm.grouped_qgemm(
            da, dw, offs, ep, out_dtype=torch.bfloat16, t=tokens, n=n, k=k,
            config=grouped_qgemm.CONFIG), warmup, iters)
        print(f"  decode A {dec_a:.0f} us, decode W {dec_w:.0f} us; on decoded operands: tiled "
              f"{tiled:.0f} ({bf16 / tiled:.2f}x); persistent " + "; ".join(sweep), flush=True)
        # The weight's codes decoded in the kernel (A decoded first): against the decoded run.
        ref = grouped_qgemm.grouped_qgemm(da, dw, offs, ep, out_dtype=torch.float32, t=tokens,
                                          n=n, k=k, config=grouped_qgemm.CONFIG)
        qm = MXFP8Tensor.from_hp(w, check_finite=False)
        km = qgemm.Operand(qgemm.FMT_MXFP8, qm.qdata, qm.scale.view(torch.uint8))
        dm = qgemm.decode_bf16(km, n, k)
        ref_m = grouped_qgemm.grouped_qgemm(da, dm, offs, ep, out_dtype=torch.float32, t=tokens,
                                            n=n, k=k, config=grouped_qgemm.CONFIG)
        in_regs = []
        for name, cfg, kb, r in (
                ("tiled", grouped_qgemm.CONFIG, kw, ref),
                *((f"persistent {c}", qgemm.TmaConfig(*c, False), kw, ref) for c in CONFIGS[:4]),
                ("MXFP8 tiled", grouped_qgemm.CONFIG, km, ref_m),
                *((f"MXFP8 persistent {c}", qgemm.TmaConfig(*c, False), km, ref_m)
                  for c in CONFIGS[:2])):
            try:
                def run(cfg=cfg, kb=kb, dt=torch.bfloat16):
                    return grouped_qgemm.grouped_qgemm(da, kb, offs, ep, out_dtype=dt, t=tokens,
                                                       n=n, k=k, config=cfg)
                us = back_to_back_us(run, warmup, iters)
                err = ((run(dt=torch.float32) - r).norm() / r.norm()).item()
                in_regs.append(f"{name}: {us:.0f} (+ decode A {bf16 / (us + dec_a):.2f}x, "
                               f"err {err:.1e})")
            except Exception as e:  # noqa: BLE001
                in_regs.append(f"{name}: {type(e).__name__} {str(e)[:120]}")
        print("  W decoded in the kernel: " + "; ".join(in_regs), flush=True)
        del x, w, qa, qw, da, dw, qm, km, dm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print("| experts, T x N x K | bf16 us | NVFP4 persistent | NVFP4 tiled | MXFP8 persistent "
          "| MXFP8 tiled |")
    main()
