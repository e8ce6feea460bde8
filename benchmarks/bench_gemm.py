"""GEMM benchmark: bf16 cuBLAS, torchao NVFP4 weight-only, and qtensor's Triton paths, side by side.

Run on one GPU (benchmarks/gpu_check.sh calls it):
    python benchmarks/bench_gemm.py --out LOGDIR/bench_gemm.md [--sweep]
or on the CPU (`--device cpu`: the weight-only layers' CPU kernels against bf16 F.linear, the
emulated reference and torchao, with the weight bytes streamed per second next to the copy's).
Prints one markdown table per section, each row a median time (triton.testing.do_bench) and the
ratio to bf16 measured in the same run (>1 means faster than bf16), plus the weight-streaming
bandwidth of the decode shapes next to the copy bandwidth. Weights smaller than 3x the 50 MB L2
are rotated among copies so that no timing reads a cached weight. Every qtensor path is first
checked against the emulated reference (relative Frobenius error of the fp32 result).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from qtensor import MXFP8Tensor, NVFP4Tensor  # noqa: E402
from qtensor.cli.analyze import stored_bytes  # noqa: E402
from qtensor.gemm.dense import emulated_mm, gemm_plan, operands, triton_mm  # noqa: E402

L2_BYTES = 50 * 2**20
ROWS: list[str] = []


def median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of fn replayed from a CUDA graph: the GPU time without Python launch costs
    (what a decode loop under CUDA graphs or torch.compile pays). NaN if fn cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as e:  # e.g. a host sync inside fn; reported as n/a in the table
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:80]})")
        torch.cuda.synchronize()
        return float("nan")


def emit(line: str) -> None:
    print(line, flush=True)
    ROWS.append(line)


def copy_bandwidth() -> float:
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e9  # TB/s: bytes read + written


def rotating(make, size_bytes: int):
    """Enough copies that together they exceed 3x the L2, and a callable cycling them."""
    copies = [make(i) for i in range(max(1, -(-3 * L2_BYTES // size_bytes)))]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    return copies, nxt


def check(a, b, name: str) -> None:
    a_op, b_op = operands(a, b)
    out = triton_mm(a_op, b_op, None, torch.float32)
    ref = emulated_mm(a_op, b_op, None, torch.float32)
    err = ((out - ref).norm() / ref.norm()).item()
    # fp32 accumulation order alone gives ~1e-5 at K = 8192 (the tests hold smaller shapes to a
    # tighter bound); anything far above that is a wrong result, not a reordering.
    print(f"check {name}: relative Frobenius error {err:.2e} vs the emulated reference")
    assert err < 1e-4, f"{name}: relative error {err:.2e} against the emulated reference"


def torchao_weight_only(w: torch.Tensor):
    """torchao 0.18's NVFP4 weight-only linear, or None where it does not run."""
    try:
        from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig
        from torchao.quantization import quantize_

        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda",
                              dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        quantize_(lin, NVFP4WeightOnlyConfig())
        lin(torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16))
        return lin
    except Exception as e:  # reported in the table, not hidden
        emit(f"torchao NVFP4 weight-only unavailable: {type(e).__name__}: {str(e)[:120]}")
        return None


def dense_section(n: int, k: int, ms_list, with_torchao: bool) -> None:
    g = torch.Generator("cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    nv_w, nv_next = rotating(lambda i: NVFP4Tensor.from_hp(w.roll(i, 0)), n * k * 9 // 16)
    mx_w, mx_next = rotating(lambda i: MXFP8Tensor.from_hp(w.roll(i, 0)), n * k * 33 // 32)
    nv_bytes, mx_bytes = stored_bytes(nv_w[0]), stored_bytes(mx_w[0])
    ao = torchao_weight_only(w) if with_torchao else None
    emit(f"\n### weight {n}x{k} (N x K)\n")
    emit("| M | path | eager us | eager vs bf16 | graph us | graph vs bf16 | weight GB/s (graph) |")
    emit("|---|---|---|---|---|---|---|")
    for m in ms_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        nv_x, mx_x = NVFP4Tensor.from_hp(x), MXFP8Tensor.from_hp(x)
        check(x, nv_w[0].t(), f"bf16 x nvfp4 M={m}")
        check(nv_x, nv_w[0].t(), f"nvfp4 x nvfp4 M={m}")
        check(mx_x, mx_w[0].t(), f"mxfp8 x mxfp8 M={m}")
        assert gemm_plan(x, nv_w[0].t()).value == "triton"
        paths = {
            "bf16 F.linear (cuBLAS)": (lambda: F.linear(x, w), n * k * 2),
            "qtensor bf16 x NVFP4 (weight-only)": (lambda: F.linear(x, nv_next()), nv_bytes),
            "qtensor bf16 x MXFP8 (weight-only)": (lambda: F.linear(x, mx_next()), mx_bytes),
            "qtensor NVFP4 x NVFP4": (lambda: F.linear(nv_x, nv_next()), nv_bytes),
            "qtensor MXFP8 x MXFP8": (lambda: F.linear(mx_x, mx_next()), mx_bytes),
        }
        if ao is not None:
            paths["torchao NVFP4 weight-only"] = (lambda: ao(x), n * k * 9 // 16)
        base = None
        for name, (fn, wbytes) in paths.items():
            eager = median_ms(fn)
            graph = graph_ms(fn) if m <= 64 else float("nan")
            base = base or (eager, graph)
            g_cols = ("- | - | -" if graph != graph else  # NaN: not timed (large M) or no graph
                      f"{graph * 1e3:.1f} | {base[1] / graph:.2f}x | {wbytes / graph / 1e6:.0f}")
            emit(f"| {m} | {name} | {eager * 1e3:.1f} | {base[0] / eager:.2f}x | {g_cols} |")


def grouped_section(experts: int, tokens=8192, k=2048, n=1536) -> None:
    g = torch.Generator("cuda").manual_seed(experts)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
    wb = w.transpose(-1, -2)
    nv_w = NVFP4Tensor.from_hp(w).transpose(-1, -2)
    mx_w = MXFP8Tensor.from_hp(w).transpose(-1, -2)
    nv_x, mx_x = NVFP4Tensor.from_hp(x, row_scaled=True), MXFP8Tensor.from_hp(x)
    paths = {
        "bf16 torch._grouped_mm": lambda: torch._grouped_mm(x, wb, offs),
        "qtensor bf16 x NVFP4": lambda: torch._grouped_mm(x, nv_w, offs),
        "qtensor NVFP4 (row-scaled) x NVFP4": lambda: torch._grouped_mm(nv_x, nv_w, offs),
        "qtensor MXFP8 x MXFP8": lambda: torch._grouped_mm(mx_x, mx_w, offs),
    }
    emit(f"\n### grouped: {experts} experts, {tokens} tokens, {k} -> {n}\n")
    emit("| path | time us | vs bf16 | TFLOP/s |")
    emit("|---|---|---|---|")
    base = None
    for name, fn in paths.items():
        ms = median_ms(fn)
        base = base or ms
        tflops = 2 * tokens * k * n / ms / 1e9
        emit(f"| {name} | {ms * 1e3:.1f} | {base / ms:.2f}x | {tflops:.0f} |")


def sweep(n=8192, k=8192) -> None:
    """Tile configs of the decode kernel (M=16, CUDA-graph times) and of the bf16 kernel that
    large M runs after decoding (M=4096), plus the decode pass and the in-register alternative."""
    from qtensor.kernels import qgemm
    from qtensor.kernels.qgemm import Config

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    nv_w, nv_next = rotating(lambda i: NVFP4Tensor.from_hp(w.roll(i, 0)), n * k * 9 // 16)
    emit(f"\n### config sweep, {n}x{k} weight\n")
    x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    for bn, bk, stages, warps, split in [(64, 256, 4, 4, 0), (128, 256, 3, 4, 0),
                                         (32, 256, 4, 4, 0), (64, 256, 3, 8, 0),
                                         (64, 256, 4, 4, 16)]:
        split = split or max(1, min(k // bk // 4, -(-4 * 132 // (n // bn))))
        cfg = Config(16, bn, bk, split, warps, stages)
        ms = graph_ms(lambda: triton_mm(x16, nv_next().t(), None, torch.bfloat16, cfg))
        emit(f"- M=16 bf16 x NVFP4 {cfg}: {ms * 1e3:.1f} us, "
             f"{stored_bytes(nv_w[0]) / ms / 1e6:.0f} GB/s")
    b = qgemm.Operand(qgemm.FMT_NVFP4, nv_w[0].qdata[None], nv_w[0].scale[None])
    ms = median_ms(lambda: qgemm.decode_bf16(b, n, k))
    emit(f"- decode_bf16 of the NVFP4 weight: {ms * 1e3:.1f} us, "
         f"{(stored_bytes(nv_w[0]) + 2 * n * k) / ms / 1e6:.0f} GB/s moved")
    x = NVFP4Tensor.from_hp(torch.randn(4096, k, device="cuda"))
    for bm, bn, bk, warps, stages in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4),
                                      (256, 128, 64, 8, 3), (128, 256, 64, 8, 4)]:
        cfg = Config(bm, bn, bk, 1, warps, stages)
        ms = median_ms(lambda: triton_mm(x, nv_next().t(), None, torch.bfloat16, cfg, True))
        emit(f"- M=4096 NVFP4 x NVFP4 decoded first, {cfg}: {ms * 1e3:.1f} us, "
             f"{2 * 4096 * n * k / ms / 1e9:.0f} TFLOP/s")
    cfg = Config(256, 128, 64, 1, 8, 3)
    ms = median_ms(lambda: triton_mm(x, nv_next().t(), None, torch.bfloat16, cfg, False))
    emit(f"- M=4096 NVFP4 x NVFP4 decoded in registers, {cfg}: {ms * 1e3:.1f} us")


def packed_weights(w: torch.Tensor):
    """The decode-layout bytes of w in each format: {fmt: (codes, scales, amax)}."""
    from qtensor import MXFP4Tensor
    from qtensor.formats import decode_layout

    n, k = w.shape
    nv, mx = NVFP4Tensor.from_hp(w), MXFP8Tensor.from_hp(w)
    m4 = MXFP4Tensor.from_hp(w)
    out = {}
    for fmt, data, scale, amax in (("nvfp4", nv.qdata, nv.scale, nv.amax),
                                   ("mxfp4", m4.qdata, m4.scale, None),
                                   ("mxfp8", mx.qdata, mx.scale, None)):
        codes, scales = decode_layout.pack(fmt, data, scale, n, k)
        out[fmt] = (codes, scales, amax)
    return out


def rotating_packed(w: torch.Tensor):
    """Each decode-layout format of w as rotating copies: {fmt: (copies, next)}, each copy
    (codes, scales, amax)."""
    return {fmt: rotating(lambda i, v=v: tuple(t.roll(i) if t is not None and t.dim() else t
                                               for t in v), v[0].numel() + v[1].numel())
            for fmt, v in packed_weights(w).items()}


def decode_section(n: int, k: int, ms_list, splits_sweep: bool) -> None:
    """The decode GEMM (qtensor::decode_mm's CUDA kernel) on each weight format against bf16
    F.linear, CUDA-graphed, with the bytes each streams per second."""
    from qtensor.ops import decode_mm as dmm

    g = torch.Generator("cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    wb_copies, wb_next = rotating(lambda i: w.roll(i, 0).contiguous(), n * k * 2)
    copies = rotating_packed(w)
    emit(f"\n### decode GEMM, weight {n}x{k} (N x K), CUDA-graphed\n")
    emit("| M | path | us | vs bf16 | weight bytes/s (TB/s) |")
    emit("|---|---|---|---|---|")
    for m in ms_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        base = graph_ms(lambda: F.linear(x, wb_next()))
        emit(f"| {m} | bf16 F.linear (cuBLAS) | {base * 1e3:.1f} | 1.00x | "
             f"{n * k * 2 / base / 1e9:.2f} |")
        for fmt, (cs, nxt) in copies.items():
            codes, scales, amax = cs[0]
            args = (x, codes, scales, amax, None, fmt, n, k, 448)
            out = dmm.cuda(*args, torch.float32)
            ref = dmm.reference(*args, torch.float32)  # the emulated reference, on the GPU
            err = ((out - ref).norm() / ref.norm()).item()
            # K * 2**-24: the scale of the fp32 summation bound; a wrong product is off by O(1)
            assert err < k * 2.0**-24, f"{fmt} M={m}: relative error {err:.2e} vs the reference"

            def run(nxt=nxt, fmt=fmt):
                c, s_, a_ = nxt()
                return dmm.cuda(x, c, s_, a_, None, fmt, n, k, 448, torch.bfloat16)

            ms = graph_ms(run)
            wbytes = codes.numel() + scales.numel()
            wide = 32 < m <= dmm.DECODE_M  # each tile of the kernel, side by side
            emit(f"| {m} | qtensor bf16 x {fmt.upper()} decode GEMM"
                 f"{' (chosen tile)' if wide else ''} | {ms * 1e3:.1f} | "
                 f"{base / ms:.2f}x | {wbytes / ms / 1e9:.2f} |")

            def serial(nxt=nxt, fmt=fmt):
                c, s_, a_ = nxt()
                return dmm._launch(x, c, s_, a_, None, fmt, n, k, 448, torch.bfloat16, pdl=False)

            if m <= 32:  # the rows where launches may overlap (decode_mm._launch)
                ms = graph_ms(serial)  # each launch waits for the previous one to complete
                emit(f"| {m} | qtensor bf16 x {fmt.upper()} decode GEMM (no launch overlap) | "
                     f"{ms * 1e3:.1f} | {base / ms:.2f}x | {wbytes / ms / 1e9:.2f} |")
            for name, tile in dmm.TILES.items() if wide else ():
                if dmm.tile_problem(tile, fmt):
                    continue

                def run_tile(nxt=nxt, fmt=fmt, tile=tile):
                    c, s_, a_ = nxt()
                    return dmm._launch(x, c, s_, a_, None, fmt, n, k, 448, torch.bfloat16,
                                       tile=tile)

                ms = graph_ms(run_tile)
                emit(f"| {m} | qtensor bf16 x {fmt.upper()} decode GEMM ({name}) | "
                     f"{ms * 1e3:.1f} | {base / ms:.2f}x | {wbytes / ms / 1e9:.2f} |")
            if m >= 64 and fmt != "mxfp4":  # the crossover: unpack for the call + dense Triton

                def dense(nxt=nxt, fmt=fmt):
                    c, s_, a_ = nxt()
                    return dmm.unpacked_mm(x, c, s_, a_, None, fmt, n, k, 448, torch.bfloat16)

                ms = graph_ms(dense)
                emit(f"| {m} | qtensor bf16 x {fmt.upper()} unpack + dense Triton | "
                     f"{ms * 1e3:.1f} | {base / ms:.2f}x | {wbytes / ms / 1e9:.2f} |")
        if splits_sweep and m in (1, 16, 64):
            codes, scales, amax = copies["nvfp4"][0][0]
            row = []
            for sp in range(1, 9):
                ms = graph_ms(lambda sp=sp: dmm._launch(x, codes, scales, amax, None, "nvfp4", n,
                                                        k, 448, torch.bfloat16, splits=sp))
                row.append(f"{sp}: {ms * 1e3:.1f}")
            emit(f"- NVFP4 M={m} by K splits (us, one weight, L2-warm above 50 MB only): "
                 + ", ".join(row))


def llama_section() -> None:
    """The decode GEMM at M = 1 on the linear shapes of a Llama layer (hidden 4096, 8 KV heads,
    intermediate 14336), and on those of its products fused by qtensor.FuseDecodeProducts
    (q/k/v, gate/up; a per-tensor amax here), against bf16 F.linear, with the floor every
    CUDA-graphed launch pays: a one-element kernel, and the decode kernel on one 64 x 64
    tile."""
    from qtensor.ops import decode_mm as dmm

    one = torch.zeros(1, device="cuda")
    emit("\n### decode GEMM on a Llama layer's shapes, M = 1, CUDA-graphed\n")
    emit(f"- one-element add: {graph_ms(lambda: one.add_(1)) * 1e3:.1f} us per launch")
    emit("\n| weight (N x K) | use | bf16 us | NVFP4 us | vs bf16 | MXFP8 us | vs bf16 "
         "| NVFP4 us, no launch overlap |")
    emit("|---|---|---|---|---|---|---|---|")
    for (n, k), use in (((64, 64), "one tile"), ((1024, 4096), "k_proj, v_proj"),
                        ((4096, 4096), "q_proj, o_proj"), ((14336, 4096), "gate, up"),
                        ((4096, 14336), "down"), ((6144, 4096), "q/k/v fused"),
                        ((28672, 4096), "gate/up fused")):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        _, wb_next = rotating(lambda i: w.roll(i, 0).contiguous(), n * k * 2)
        base = graph_ms(lambda: F.linear(x, wb_next()))
        cells = []
        for fmt, (codes, scales, amax) in packed_weights(w).items():
            if fmt == "mxfp4":
                continue
            _, nxt = rotating(lambda i, c=codes, s_=scales: (c.roll(i), s_.roll(i)),
                              codes.numel() + scales.numel())

            def run(nxt=nxt, fmt=fmt, amax=amax):
                c, s_ = nxt()
                return dmm.cuda(x, c, s_, amax, None, fmt, n, k, 448, torch.bfloat16)

            ms = graph_ms(run)
            cells += [f"{ms * 1e3:.1f}", f"{base / ms:.2f}x"]
            if fmt == "nvfp4":
                serial = graph_ms(lambda nxt=nxt, amax=amax: dmm._launch(
                    x, *nxt(), amax, None, fmt, n, k, 448, torch.bfloat16, pdl=False))
        emit(f"| {n}x{k} | {use} | {base * 1e3:.1f} | " + " | ".join(cells) +
             f" | {serial * 1e3:.1f} |")


# ---- the CPU: the C++ kernels of csrc/gemm_cpu.cpp against bf16 and the reference ---------------


def cpu_ms(fn, reps: int = 9) -> float:
    """Best milliseconds of fn() over `reps` calls, after a warm-up call: on a shared machine
    the other processes only ever add time."""
    import time

    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def cpu_copy_bandwidth() -> float:
    """GB/s of copying 256 MB (bytes read + written) on this CPU's threads."""
    src = torch.randn(2**26)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / cpu_ms(lambda: dst.copy_(src)) / 1e6


def torchao_cpu_weight_only(w: torch.Tensor):
    """torchao 0.18's NVFP4 weight-only linear on the CPU, or None where it does not run."""
    try:
        from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig
        from torchao.quantization import quantize_

        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        quantize_(lin, NVFP4WeightOnlyConfig())
        lin(torch.randn(1, w.shape[1], dtype=torch.bfloat16))
        return lin
    except Exception as e:  # reported in the table, not hidden
        emit(f"torchao NVFP4 weight-only on the CPU unavailable: {type(e).__name__}: "
             f"{str(e)[:120]}")
        return None


def cpu_section(n: int, k: int, ms_list) -> None:
    """bf16 F.linear (oneDNN), the weight-only layers of each format (the CPU kernels) and the
    emulated reference they replace, per M; each qtensor path first checked against the
    reference (relative Frobenius error of the fp32 result)."""
    from qtensor import MXFP4Tensor

    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, dtype=torch.bfloat16, generator=g) * 0.02
    weights = {"NVFP4": NVFP4Tensor.from_hp(w), "MXFP4": MXFP4Tensor.from_hp(w),
               "MXFP8": MXFP8Tensor.from_hp(w)}
    ao = torchao_cpu_weight_only(w)
    emit(f"\n### weight {n}x{k} (N x K), CPU\n")
    emit("| M | path | best ms | vs bf16 | weight GB/s | rel. error vs reference |")
    emit("|---|---|---|---|---|---|")
    for m in ms_list:
        x = torch.randn(m, k, dtype=torch.bfloat16, generator=g)
        base = cpu_ms(lambda: F.linear(x, w))
        emit(f"| {m} | bf16 F.linear | {base:.3f} | 1.00x | {n * k * 2 / base / 1e6:.1f} | |")
        for name, qw in weights.items():
            a_op, b_op = operands(x, qw.t())
            ref = emulated_mm(a_op, b_op, None, torch.float32)
            got = F.linear(x.float(), qw)  # the same values, an fp32 output: the sums alone
            err = ((got - ref).norm() / ref.norm()).item()
            t = cpu_ms(lambda: F.linear(x, qw))
            wbytes = stored_bytes(qw)
            emit(f"| {m} | qtensor bf16 x {name} (CPU kernel) | {t:.3f} | {base / t:.2f}x | "
                 f"{wbytes / t / 1e6:.1f} | {err:.1e} |")
            if m <= 16 or name == "NVFP4":
                r = cpu_ms(lambda: emulated_mm(a_op, b_op, None, torch.bfloat16), reps=3)
                emit(f"| {m} | reference (emulated) bf16 x {name} | {r:.3f} | {base / r:.2f}x | "
                     f"{wbytes / r / 1e6:.1f} | |")
        if ao is not None:
            t = cpu_ms(lambda: ao(x), reps=3)
            emit(f"| {m} | torchao NVFP4 weight-only | {t:.3f} | {base / t:.2f}x | "
                 f"{n * k * 9 // 16 / t / 1e6:.1f} | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="markdown file for the tables")
    p.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    p.add_argument("--ms", default="1,16,64,4096,16384", help="comma-separated M values")
    p.add_argument("--quick", action="store_true", help="8192x8192 only, no torchao or grouped")
    p.add_argument("--decode", action="store_true",
                   help="only the decode GEMM sections (M = 1, 4, 16, 64, 128 unless --ms)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the CPU kernels' table (M = 1, 4, 16, 64, 256 unless --ms)")
    args = p.parse_args()
    ms_list = [int(v) for v in args.ms.split(",")]
    date = datetime.date.today().isoformat()
    if args.device == "cpu":
        ms_cpu = ms_list if "--ms" in sys.argv else [1, 4, 16, 64, 256]
        emit(f"## GEMM benchmark, {date}, CPU x{torch.get_num_threads()} threads, torch "
             f"{torch.__version__}")
        emit(f"copy bandwidth: {cpu_copy_bandwidth():.1f} GB/s (read + write)")
        for n, k in [(4096, 4096)] if args.quick else [(4096, 4096), (14336, 4096), (4096, 14336)]:
            cpu_section(n, k, ms_cpu)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(ROWS) + "\n")
        return
    emit(f"## GEMM benchmark, {date}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    emit(f"copy bandwidth: {copy_bandwidth():.2f} TB/s (read + write)")
    if args.decode:
        ms_dec = ms_list if "--ms" in sys.argv else [1, 4, 16, 64, 128]
        for n, k in [(8192, 8192), (28672, 8192), (8192, 28672)]:
            decode_section(n, k, ms_dec, splits_sweep=(n, k) == (8192, 8192) and args.sweep)
        llama_section()
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(ROWS) + "\n")
        return
    for n, k in [(8192, 8192)] if args.quick else [(8192, 8192), (28672, 8192), (8192, 28672)]:
        dense_section(n, k, ms_list, with_torchao=not args.quick)
    for experts in () if args.quick else (8, 64):
        grouped_section(experts)
    if args.sweep:
        sweep()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(ROWS) + "\n")


if __name__ == "__main__":
    main()
