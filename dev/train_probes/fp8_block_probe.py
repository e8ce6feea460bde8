"""Which scale layouts make torch._scaled_mm's FP8 block GEMM (1x128 x 128x128, 1x128 x 1x128)
equal the exact reference on this GPU, per shape; and its time beside bf16 at 8192^3.

    python dev/train_probes/fp8_block_probe.py OUT_DIR
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import cuda_time_ms  # noqa: E402

from qtensor.formats import fp8_block as ref
from qtensor.ops.gemm_ops import reference_fp8_block_mm

ROWS, TILES = ref.FP8BlockSpec("1x128"), ref.FP8BlockSpec("128x128")


def cm(t):  # column-major copy
    return t.t().contiguous().t()


def pad_cols(t, mult):  # [R, C] -> a view [R, C] of storage [R, round_up(C, mult)]
    c = t.shape[1]
    cp = -(-c // mult) * mult
    s = t.new_zeros(t.shape[0], cp)
    s[:, :c] = t
    return s[:, :c]


def pad_rows_cm(t, mult):  # [R, C] column-major with leading dim round_up(R, mult)
    r = t.shape[0]
    rp = -(-r // mult) * mult
    s = t.new_zeros(t.shape[1], rp)
    s[:, :r] = t.t()
    return s.t()[:r]


def a_variants(a_s):
    return {"cm": cm(a_s), "cm_ld4": pad_rows_cm(a_s, 4)}


def b_variants(b_s, tiles):
    if tiles:  # b_s [N/128, K/128]
        return {"(N/128,K/128) strides (1,N/128)": cm(b_s),
                "(K/128,N/128) strides (1,K/128) [b_s.t()]": b_s.t(),
                "(K/128,N/128) rowmajor": b_s.t().contiguous(),
                "b_s.t() ld4": pad_cols(b_s, 4).t(),
                "cm ld4": pad_rows_cm(b_s, 4)}
    return {"(K/128,N) rowmajor": b_s.t().contiguous(), "b_s.t()": b_s.t(),
            "b_s.t() ld4": pad_cols(b_s, 4).t()}


def main():
    out = sys.argv[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| M, N, K (K blocks) | b | scale_a | scale_b | result |", "|---|---|---|---|---|"]
    shapes = [(256, 384, 512), (256, 512, 384), (384, 512, 256), (256, 512, 1024),
              (512, 640, 640), (260, 512, 512), (2048, 1536, 768), (1024, 1024, 1024)]
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
        a, a_s = ref.quantize(x, ROWS)
        for tiles in (True, False):
            if tiles and n % 128:
                continue
            b, b_s = ref.quantize(w, TILES if tiles else ROWS)
            want = reference_fp8_block_mm(a, a_s, b, b_s, tiles, None, torch.float32)
            for an, sa in a_variants(a_s).items():
                for bn, sb in b_variants(b_s, tiles).items():
                    try:
                        got = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                               out_dtype=torch.float32)
                        err = ((got - want).abs().max() / want.abs().max()).item()
                        res = f"{'MATCH' if err < 2e-3 else 'differs'} {err:.1e}"
                    except Exception as e:  # noqa: BLE001
                        res = "refused: " + str(e).splitlines()[0][:80]
                    lines.append(f"| {m}, {n}, {k} ({k // 128}) | {'128x128' if tiles else '1x128'} "
                                 f"| {an} {tuple(sa.stride())} | {bn} {tuple(sb.stride())} | {res} |")
                    print(lines[-1], flush=True)
    # time at 8192^3
    m = n = k = 8192
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.05).bfloat16()
    a, a_s = ref.quantize(x, ROWS)
    b, b_s = ref.quantize(w, TILES)

    def t(fn):
        return cuda_time_ms(fn, 3, 10)
    bf = t(lambda: x @ w.t())
    lines.append("")
    lines.append(f"8192^3: bf16 {bf:.3f} ms; emulated {t(lambda: reference_fp8_block_mm(a, a_s, b, b_s, True, None, torch.bfloat16)):.3f} ms")
    for bn, sb in b_variants(b_s, True).items():
        try:
            ms = t(lambda: torch._scaled_mm(a, b.t(), scale_a=cm(a_s), scale_b=sb, out_dtype=torch.bfloat16))
            lines.append(f"8192^3 native {bn}: {ms:.3f} ms ({bf / ms:.2f}x bf16)")
        except Exception as e:  # noqa: BLE001
            lines.append(f"8192^3 native {bn}: refused {str(e).splitlines()[0][:80]}")
    open(f"{out}/fp8_block_probe.md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines[-8:]))


if __name__ == "__main__":
    main()
