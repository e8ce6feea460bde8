"""Quantization kernels against memory bandwidth, side by side with their peers.

GPU: per kernel and shape, the median time of one call (CUDA events around 5 calls back to back,
inputs rotated past the 50 MB L2), the effective bandwidth of the bytes that must move (input
read once, outputs written once) and its ratio to the device-to-device copy measured in the same
run; torchao's compiled `to_nvfp4` / `to_mx` and the compiled pure-torch reference beside them.
Two more columns say what bounds each call: "GPU us", the same 5 calls replayed from a CUDA graph
(the kernels' time alone), and "host us", the host's time to issue one call (Python, the op
dispatch, allocation, the launches). Where host us exceeds GPU us, "us" is the host's time.
CPU: the C++ kernels against the pure-torch reference on a 4096x4096 bf16 tensor.

    python benchmarks/bench_quantize.py [--device cuda|cpu] [--out FILE] [--no-peers]
                                        [--cases "nvfp4 row,nvfp4 4o6 mae"] [--shapes 4096x4096]

--cases keeps the GPU rows named (and the copy, every ratio's reference; a row's "vs" peer only
where it is named too), for a quick comparison of builds. --shapes replaces the GPU shapes (the
compiled peers run on the first); a tensor that fits in L2 (4096x4096 bf16 is 32 MB) shows what
a dynamic cast's second read finds there.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import time

import torch
from _common import capture_graph, loop_us

from qtensor.formats import mxfp8, nvfp4
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed, sr_state_tensor
from qtensor.ops import quant as Q

SHAPES = ((16384, 8192), (8192, 5120), (1024, 2048))
NV_OUT = 0.5 + 1 / 16  # bytes per element written by NVFP4: codes + one E4M3 scale per 16
MX_OUT = 1 + 1 / 32  # MXFP8: one byte + one UE8M0 scale per 32


def time_cuda(fn, inputs, iters=20, calls=5) -> float:
    """Median seconds of one fn(x) call, cycling through `inputs` so each call misses the L2.

    Each sample times `calls` calls back to back between two events and divides: the host
    enqueues the next call while the GPU runs this one, so the host's time per call (Python and
    the op dispatch, some 10 us) stays out of the figure where the kernel is the longer of the
    two, as in a training step; with one call per sample the GPU would wait for the host first."""
    for x in inputs:  # every input once: what a case caches per input (its amax) is made here
        fn(x)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(calls):
            fn(inputs[(i * calls + j) % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return sorted(times)[len(times) // 2]


def graph_cuda(fn, inputs, iters=20, calls=5) -> float:
    """Median seconds of one fn(x) call replayed from a CUDA graph of `calls` calls on distinct
    inputs: the GPU's time without the host's."""
    graph = capture_graph([functools.partial(fn, inputs[j % len(inputs)]) for j in range(calls)])
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def host_cuda(fn, inputs, iters=20, calls=5) -> float:
    """Median seconds the host takes to issue one fn(x) call (`calls` calls on distinct inputs,
    after a sync, far fewer than fill the launch queue)."""
    return loop_us([functools.partial(fn, inputs[j % len(inputs)]) for j in range(calls)],
                   reps=iters, wait=False) * 1e-6


def gpu_cases(shape):
    """(name, fn(x), bytes per input element moved, peer name for the ratio column)."""
    col, col_rht_sr = NVFP4Spec(columnwise=True), NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    # The (seed, offset) state tensor is made once on the GPU, as a training module holds it: an
    # SRSeed would add a host-to-device copy to every timed call.
    sr = sr_state_tensor(SRSeed(1, 0), "cuda")
    amax = {}

    def given(spec):  # the amax is computed once, outside the timed region
        def fn(x):
            key = (id(x), spec.columnwise, spec.rht, spec.row_scaled)
            if key not in amax:
                amax[key] = Q.amax(x, columnwise=spec.columnwise, rht=spec.rht, per_row=spec.row_scaled)
            return Q.nvfp4_codes(x, amax[key], spec, sr if spec.stochastic_rounding else None)
        return fn

    def hybrid(rht_sr):  # MXFP8 rowwise + NVFP4 columnwise from one read (dgrad_mxfp8's gradient)
        def fn(x):
            key = (id(x), True, rht_sr, False)
            if key not in amax:
                amax[key] = Q.amax(x, columnwise=True, rht=rht_sr)
            return torch.ops.qtensor.hybrid_quantize.default(
                x, amax[key], 0, 0, 448, rht_sr, rht_sr, sr if rht_sr else None)
        return fn

    return [
        ("copy", lambda x: x.clone(), 4, None),
        ("amax", lambda x: Q.amax(x), 2, None),
        ("nvfp4 row", given(NVFP4Spec()), 2 + NV_OUT, None),
        ("nvfp4 col", given(col), 2 + NV_OUT, None),
        ("nvfp4 col rht+sr", given(col_rht_sr), 2 + NV_OUT, "nvfp4 col"),
        ("amax rht (col)", lambda x: Q.amax(x, columnwise=True, rht=True), 2, None),
        ("nvfp4 amax+col rht+sr", lambda x: Q.quantize_nvfp4(x, col_rht_sr, sr), 4 + NV_OUT,
         "nvfp4 col rht+sr"),
        ("nvfp4 2d", given(NVFP4Spec(block_2d=True)), 2 + NV_OUT, None),
        ("nvfp4 rowscaled", given(NVFP4Spec(row_scaled=True)), 2 + NV_OUT, "nvfp4 row"),
        ("nvfp4 4o6 mae", given(NVFP4Spec(fourover6="mae", e4m3_bound=256)), 2 + NV_OUT, "nvfp4 row"),
        ("nvfp4 4o6 mse 2d", given(NVFP4Spec(fourover6="mse", block_2d=True, e4m3_bound=256)), 2 + NV_OUT, "nvfp4 row"),
        ("nvfp4 amax+row", lambda x: Q.quantize_nvfp4(x, NVFP4Spec()), 4 + NV_OUT, "nvfp4 row"),
        ("mxfp8 row", lambda x: Q.mxfp8_both(x, "rceil", True, False), 2 + MX_OUT, None),
        ("mxfp8 col", lambda x: Q.mxfp8_both(x, "rceil", False, True), 2 + MX_OUT, None),
        ("mxfp8 both", lambda x: Q.mxfp8_both(x, "rceil", True, True), 2 + 2 * MX_OUT, None),
        ("hybrid grad", hybrid(False), 2 + MX_OUT + NV_OUT, "nvfp4 col"),
        ("hybrid grad rht+sr", hybrid(True), 2 + MX_OUT + NV_OUT, "nvfp4 col rht+sr"),
        # The training step's gradient cast: its amax after RHT, then the hybrid cast under it.
        ("amax+hybrid grad rht+sr", lambda x: Q.quantize_hybrid_grad(x, "rceil", col_rht_sr, sr),
         4 + MX_OUT + NV_OUT, "hybrid grad rht+sr"),
    ]


def peer_cases():
    """Compiled peers on the first shape: torchao's quantizers and the compiled reference."""
    cases = []
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

        def ao_nvfp4(x):
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))

        cases.append(("torchao to_nvfp4 (compiled)", torch.compile(ao_nvfp4), 2 + NV_OUT, "nvfp4 row"))
        cases.append(("torchao to_mx e4m3 (compiled)", torch.compile(
            lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, 32)), 2 + MX_OUT, "mxfp8 row"))
    except ImportError as e:
        print(f"# torchao not importable ({e}); its peers are skipped")
    cases.append(("reference nvfp4 (compiled)", torch.compile(
        lambda x: nvfp4.quantize(x, NVFP4Spec())), 2 + NV_OUT, "nvfp4 row"))
    return cases


def select_cases(cases, names: list[str] | None):
    """The cases named (the copy always first), or all; an unknown name raises with the known ones."""
    if not names:
        return cases
    known = [c[0] for c in cases]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"bench_quantize: --cases {unknown} not among the rows {known}")
    return [c for c in cases if c[0] == "copy" or c[0] in names]


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"MxK,MxK" -> ((M, K), ...); K a multiple of 32 (every row's kernels take it)."""
    shapes = []
    for item in text.split(","):
        m, sep, k = item.strip().lower().partition("x")
        if not (sep and m.isdigit() and k.isdigit() and int(m) > 0 and int(k) > 0 and int(k) % 32 == 0):
            raise SystemExit(f"bench_quantize: --shapes takes MxK pairs with K a positive multiple of 32, "
                             f"comma-separated (e.g. 4096x4096); got {item!r}")
        shapes.append((int(m), int(k)))
    return tuple(shapes)


def run_gpu(peers: bool, lines: list[str], names: list[str] | None = None, shapes=SHAPES) -> None:
    dev = torch.cuda.get_device_name()
    lines.append(f"# {datetime.date.today()} {dev}, torch {torch.__version__}, {Q.extension_status()}")
    lines.append("| shape | kernel | us | GB/s | of copy | vs | GPU us | host us |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for si, (m, k) in enumerate(shapes):
        n = m * k
        rotate = max(2, int(4 * 60e6 // (2 * n)) + 1)  # > 4x the L2 across the set
        inputs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(rotate)]
        own = select_cases(gpu_cases((m, k)), names)
        cases = own + (peer_cases() if peers and si == 0 else [])
        times, copy_bw = {}, None
        for ci, (name, fn, bpe, peer) in enumerate(cases):
            try:
                t = time_cuda(fn, inputs)
            except Exception as e:  # a peer that fails to compile is reported, not fatal
                failed = f"failed: {type(e).__name__}: {str(e)[:80]}"
                lines.append(f"| {m}x{k} | {name} | {failed} | | | | | |")
                continue
            times[name] = t
            bw = bpe * n / t
            copy_bw = copy_bw or bw
            vs = f"{t / times[peer]:.2f}x the time of {peer}" if peer in times else ""
            bound = bound_columns(fn, inputs) if ci < len(own) else "|"
            lines.append(f"| {m}x{k} | {name} | {t * 1e6:.1f} | {bw / 1e9:.0f} | {bw / copy_bw:.2f} "
                         f"| {vs} | {bound} |")
            print(lines[-1], flush=True)


def bound_columns(fn, inputs) -> str:
    """The "GPU us" and "host us" cells of one of qtensor's cases (the compiled peers are left
    out); a call that a CUDA graph cannot capture gives its error in the GPU cell."""
    try:
        gpu = f"{graph_cuda(fn, inputs) * 1e6:.1f}"
    except Exception as e:
        torch.cuda.synchronize()
        gpu = f"not captured: {type(e).__name__}"
    return f"{gpu} | {host_cuda(fn, inputs) * 1e6:.1f}"


def run_cpu(lines: list[str]) -> None:
    x = torch.randn(4096, 4096).bfloat16()
    lines.append(f"# {datetime.date.today()} CPU x{torch.get_num_threads()} threads, 4096x4096 bf16, "
                 f"{Q.extension_status()}")
    lines.append("| op | reference s | C++ kernel s | speedup |")
    lines.append("|---|---|---|---|")
    cases = [
        ("nvfp4 row (amax incl.)", lambda: nvfp4.quantize(x, NVFP4Spec()), lambda: Q.quantize_nvfp4(x, NVFP4Spec())),
        ("nvfp4 col", lambda: nvfp4.quantize(x, NVFP4Spec(columnwise=True)),
         lambda: Q.quantize_nvfp4(x, NVFP4Spec(columnwise=True))),
        ("nvfp4 4o6 mae", lambda: nvfp4.quantize(x, NVFP4Spec(fourover6="mae", e4m3_bound=256)),
         lambda: Q.quantize_nvfp4(x, NVFP4Spec(fourover6="mae", e4m3_bound=256))),
        ("mxfp8 row", lambda: mxfp8.quantize(x, MXFP8Spec()), lambda: Q.quantize_mxfp8(x, MXFP8Spec())),
        ("nvfp4 row-scaled (amax incl.)", lambda: nvfp4.quantize(x, NVFP4Spec(row_scaled=True)),
         lambda: Q.quantize_nvfp4(x, NVFP4Spec(row_scaled=True))),
        ("nvfp4 4o6 mse", lambda: nvfp4.quantize(x, NVFP4Spec(fourover6="mse", e4m3_bound=256)),
         lambda: Q.quantize_nvfp4(x, NVFP4Spec(fourover6="mse", e4m3_bound=256))),
        ("mxfp8 col", lambda: mxfp8.quantize(x, MXFP8Spec(columnwise=True)),
         lambda: Q.quantize_mxfp8(x, MXFP8Spec(columnwise=True))),
    ]
    for name, ref, ker in cases:
        tr, tk = best_of(ref), best_of(ker)
        lines.append(f"| {name} | {tr:.4f} | {tk:.4f} | {tr / tk:.1f}x |")
        print(lines[-1], flush=True)


def best_of(fn, n=3) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--no-peers", action="store_true", help="skip the compiled peers (faster)")
    p.add_argument("--cases", help="comma-separated GPU rows to run (the copy always runs)")
    p.add_argument("--shapes", help="comma-separated MxK GPU shapes (default: %s)"
                   % ",".join(f"{m}x{k}" for m, k in SHAPES))
    args = p.parse_args()
    names = [n.strip() for n in args.cases.split(",")] if args.cases else None
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    lines: list[str] = []
    if args.device == "cuda":
        run_gpu(not args.no_peers, lines, names, shapes)
    else:
        run_cpu(lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
