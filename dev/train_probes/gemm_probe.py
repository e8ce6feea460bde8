"""Where a large quantized GEMM's time goes, and the persistent TMA kernel's tile configs.

For the Llama-8B MLP's training GEMMs at 8192 tokens and some smaller products (NVFP4 x NVFP4,
MXFP8 x MXFP8): bf16 cuBLAS, qtensor's product as dispatched (decode both operands, then a bf16
kernel), the two decodes alone, the tiled Triton kernel alone, cuBLAS on the decoded operands
with an fp32 result, and each TmaConfig of CFGS (its largest difference from the tiled kernel's
result, in bf16, over the result's largest magnitude: a sanity check; tests/test_gemm_triton.py
holds the bound). Each call is timed alone (CUDA events, synchronized), so small products show
host time too.

    python dev/train_probes/gemm_probe.py OUT_DIR
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import cuda_time_ms  # noqa: E402

from qtensor import MXFP8Tensor, NVFP4Tensor  # noqa: E402
from qtensor.gemm.dense import dense_sides, operands, quantized_mm
from qtensor.kernels import qgemm
from qtensor.ops import gemm_triton
from qtensor.ops.gemm_operands import epilogue_terms, reduction_k

TensorDescriptor = qgemm.TensorDescriptor


def bench(fn, iters=20, warmup=5):
    """GPU microseconds of one call (median; benchmarks/_common.py's timer)."""
    return 1e3 * cuda_time_ms(fn, warmup, iters)


def tma_gemm(a, b, ep, out_dtype, cfg):
    m, n = a.shape[0], b.shape[0]
    return qgemm.qgemm(qgemm.Operand(0, a, None), qgemm.Operand(0, b, None), ep,
                       out_dtype=out_dtype, m=m, n=n, k=a.shape[1], config=qgemm.TmaConfig(*cfg))[0]


def decode_sweep(x, rows, k):
    """decode_bf16's kernel at other tile shapes (us)."""
    out = torch.empty((1, rows, k), dtype=torch.bfloat16, device=x.data.device)
    (d_b, d_r, d_k), (s_b, s_r, s_k) = x.strides()
    res = {}
    for br, bk, w in ((32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 512, 8), (128, 256, 8), (16, 512, 4)):
        grid = (triton.cdiv(rows, br), triton.cdiv(k, bk), 1)
        res[(br, bk, w)] = bench(lambda: qgemm._DECODE(grid, x.data, x.scale, d_b, d_r, d_k, s_b, s_r, s_k, out, rows, k,
                                                       FMT=x.fmt, BR=br, BK=bk, num_warps=w))
    return res


SHAPES = {  # (M, N, K) of y = a @ b^T
    "fprop gate/up 8192x14336x4096": (8192, 14336, 4096),
    "fprop down 8192x4096x14336": (8192, 4096, 14336),
    "8192^3": (8192, 8192, 8192),
    "wgrad gate 14336x4096x8192": (14336, 4096, 8192),
    "wgrad down 4096x14336x8192": (4096, 14336, 8192),
    "gpt mlp 8192x1408x512": (8192, 1408, 512),
    "gpt mlp down 8192x512x1408": (8192, 512, 1408),
    "gpt wgrad 512x1408x8192": (512, 1408, 8192),
    "mid 4096x4096x4096": (4096, 4096, 4096),
    "qwen expert 2048x1536x2048": (2048, 1536, 2048),
}
CFGS = [(128, 128, 64, 4, 4, True), (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 3, False),
        (128, 256, 64, 8, 4, False), (128, 128, 64, 8, 4, True), (128, 128, 64, 4, 5, True),
        (256, 128, 64, 8, 3, False), (128, 256, 64, 4, 3, True), (128, 128, 128, 4, 3, True)]


def main():
    out_dir = sys.argv[1]
    torch.manual_seed(0)
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", ""]
    lines.append("| shape | fmt | bf16 cuBLAS us | qtensor us | vs bf16 | decode a+b us | tiled hp gemm us | cuBLAS fp32-out us | best candidate us (cfg) | cand vs bf16 | cand err/ref |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, (m, n, k) in SHAPES.items():
        a_hp = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b_hp = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bf = bench(lambda: a_hp @ b_hp.t())
        for fmt_name, cls in (("nvfp4", NVFP4Tensor), ("mxfp8", MXFP8Tensor)):
            qa = cls.from_hp(a_hp, check_finite=False) if fmt_name == "mxfp8" else cls.from_hp(a_hp)
            qb = cls.from_hp(b_hp)
            q = bench(lambda: quantized_mm(qa, qb.t(), out_dtype=torch.bfloat16))
            a_op, b_op = operands(qa, qb.t())
            fmt, sa, sb, _ = dense_sides(a_op, b_op)
            ka = gemm_triton.kernel_operand(fmt, sa, qgemm)
            kb = gemm_triton.kernel_operand(fmt, sb, qgemm)
            kk = reduction_k(fmt, sb)
            dec = bench(lambda: (qgemm.decode_bf16(ka, m, kk), qgemm.decode_bf16(kb, n, kk)))
            if label.startswith("fprop gate"):
                print(f"  decode sweep a {fmt_name}: {decode_sweep(ka, m, kk)}", flush=True)
            da, db = qgemm.decode_bf16(ka, m, kk), qgemm.decode_bf16(kb, n, kk)
            ep = qgemm.Epilogue(*epilogue_terms(fmt, sa, sb), None)
            tiled = qgemm.pick_config(m, n, kk, 1, qgemm._sm_count(0))
            hp = bench(lambda: qgemm.qgemm(da, db, ep, out_dtype=torch.bfloat16, m=m, n=n, k=kk,
                                           config=tiled))
            a2, b2 = da.data.reshape(m, kk), db.data.reshape(n, kk)
            try:
                cub = bench(lambda: torch.mm(a2, b2.t(), out_dtype=torch.float32))
            except Exception as e:  # noqa: BLE001
                cub = float("nan")
                print("cuBLAS fp32 out:", e)
            ref = qgemm.qgemm(da, db, ep, out_dtype=torch.float32, m=m, n=n, k=kk,
                              config=tiled)[0]
            best = (float("inf"), None, float("nan"))
            timings = []
            if TensorDescriptor is not None:
                for cfg in (CFGS if fmt_name == "nvfp4" else top2):
                    try:
                        got = tma_gemm(a2, b2, ep, torch.bfloat16, cfg).float()
                        err = ((got - ref.bfloat16().float()).abs().max() / ref.abs().max()).item()
                        t = bench(lambda: tma_gemm(a2, b2, ep, torch.bfloat16, cfg))
                        print(f"  {label} {fmt_name} cand {cfg}: {t:.1f} us err {err:.2e}", flush=True)
                        timings.append((t, cfg))
                        if t < best[0]:
                            best = (t, cfg, err)
                    except Exception as e:  # noqa: BLE001
                        print(f"  cand {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            row = (f"| {label} | {fmt_name} | {bf:.0f} | {q:.0f} | {bf / q:.3f}x | {dec:.0f} | {hp:.0f} | "
                   f"{cub:.0f} | {best[0]:.0f} {best[1]} | {bf / best[0]:.3f}x | {best[2]:.1e} |")
            lines.append(row)
            print(row, flush=True)
            if fmt_name == "nvfp4":
                top2 = [c for _, c in sorted(timings)[:2]]
            del qa, qb, da, db, ref
        torch.cuda.empty_cache()
    with open(f"{out_dir}/gemm_probe.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
