"""Host time of one quantized linear call, and the cost of `from_hp`'s finiteness check.

Run on one GPU (benchmarks/gpu_check.sh calls it):
    python benchmarks/bench_overhead.py [--out LOGDIR/bench_overhead.md]
For F.linear on an 8192x8192 weight at M=1 (bf16, and each weight-only and dynamic config):
- host us: CPU time per call, from a loop of 40 calls issued back to back after a sync (short
  enough that the launch queue never fills, so the loop's time is the host's);
- wall us: a synchronized loop's time per call (max of host and GPU time), the eager speed;
- graph us: the same call replayed from a CUDA graph (GPU time only);
- and the ratio of bf16's wall time to the path's (>= 1 means as fast as bf16).
The qtensor rows are also timed without the prepared decode path (the GEMM layer and the op
each call), then also with the direct Triton launch off, or through the dispatcher, to show
what each saves. The weight-only formats in the decode layout (DecodeWeight, what layout="auto"
makes on a GPU with the decode kernel) get their own table: host us of F.linear and of each
layer below it, down to the C++ op's launch (its checks, the tensor maps, the cluster launch).
Then `from_hp` on 16384x8192 bf16 (GPU) and 4096x4096 (CPU): the default (check_finite=True)
against check_finite=False.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import capture_graph, loop_us  # noqa: E402

from qtensor import MXFP8Spec, MXFP8Tensor, NVFP4Spec, NVFP4Tensor  # noqa: E402
from qtensor.ops import gemm_ops  # noqa: E402

ROWS: list[str] = []


def emit(line: str) -> None:
    print(line, flush=True)
    ROWS.append(line)


def host_us(fn) -> float:
    """CPU time per call: 40 calls never fill the launch queue, so the loop is the host's."""
    fn()
    return loop_us([fn] * 40, reps=15, wait=False)


def wall_us(fn, calls: int = 200) -> float:
    """Wall time per call of a synchronized loop (max of host and GPU time)."""
    fn()
    return loop_us([fn] * calls, reps=7, wait=True)


def graph_us(fn, calls: int = 20) -> float:
    g = capture_graph([fn] * calls)
    return wall_us(g.replay, calls=10) / calls


@contextlib.contextmanager
def no_direct_launch():
    from qtensor.kernels import grouped_qgemm, qgemm

    launchers = [qgemm._QGEMM, qgemm._SPLITK_EPILOGUE, qgemm._DECODE, grouped_qgemm._GROUPED]
    saved = [lnc.direct for lnc in launchers]
    for lnc in launchers:
        lnc.direct = False
    try:
        yield
    finally:
        for lnc, d in zip(launchers, saved):
            lnc.direct = d


@contextlib.contextmanager
def no_plan():
    """Without the prepared decode path ([Note: prepared linear]): the GEMM layer and the op."""
    from qtensor.gemm import dense as gemm

    saved = gemm._prepared_linear
    gemm._prepared_linear = lambda x, weight, bias: None
    try:
        yield
    finally:
        gemm._prepared_linear = saved


@contextlib.contextmanager
def through_dispatcher():
    saved = gemm_ops._direct_ok
    gemm_ops._direct_ok = lambda tensors: False
    try:
        yield
    finally:
        gemm_ops._direct_ok = saved


def linear_section(n: int, k: int, m: int) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    weights = {
        "bf16 F.linear": w,
        "NVFP4 weight-only": NVFP4Tensor.from_hp(w),
        "MXFP8 weight-only": MXFP8Tensor.from_hp(w),
        "NVFP4 dynamic": NVFP4Tensor.from_hp(w).replace(act_spec=NVFP4Spec()),
        "MXFP8 dynamic": MXFP8Tensor.from_hp(w).replace(act_spec=MXFP8Spec()),
    }
    emit(f"\n### F.linear, {n}x{k} weight, M={m}\n")
    emit("| path | host us | wall us | graph us | bf16 wall / wall | host, no plan "
         "| host, no plan, no direct launch | host, no plan, via dispatcher |")
    emit("|---|---|---|---|---|---|---|---|")
    base = None
    with torch.no_grad():
        for name, wt in weights.items():
            def fn(wt=wt):
                return F.linear(x, wt)

            h, wl, gr = host_us(fn), wall_us(fn), graph_us(fn)
            base = base or wl
            extra = ["", "", ""]
            if name != "bf16 F.linear":
                with no_plan():
                    extra[0] = f"{host_us(fn):.1f}"
                    with no_direct_launch():
                        extra[1] = f"{host_us(fn):.1f}"
                    with through_dispatcher():
                        extra[2] = f"{host_us(fn):.1f}"
            emit(f"| {name} | {h:.1f} | {wl:.1f} | {gr:.1f} | {base / wl:.2f}x | "
                 + " | ".join(extra) + " |")
    decode_layers_section(w, x, base)


def decode_layers_section(w: torch.Tensor, x: torch.Tensor, bf16_wall: float) -> None:
    """Host us of an eager F.linear on a DecodeWeight and of each layer it calls: the tensor
    subclass's dispatch, qtensor::decode_mm (direct, and through the dispatcher), the op's CUDA
    function (its checks and path choice) and the C++ op alone (its checks, the tensor maps and
    the cluster launch)."""
    from qtensor import MXFP4Tensor
    from qtensor.ops import decode_mm as dmm
    from qtensor.tensors.decode import DecodeWeight

    if dmm.device_kernel_problem(x.device, "nvfp4"):
        return
    emit("\n| decode layout | F.linear host us | wall us | graph us | bf16 wall / wall "
         "| decode_mm | via dispatcher | op's CUDA function | C++ op |")
    emit("|---|---|---|---|---|---|---|---|---|")
    n, k = w.shape
    with torch.no_grad():
        for name, cls in (("NVFP4", NVFP4Tensor), ("MXFP4", MXFP4Tensor), ("MXFP8", MXFP8Tensor)):
            dw = DecodeWeight.pack(cls.from_hp(w))
            args = (x, dw.codes, dw.scales, dw.amax, None, dw.fmt, n, k, dw.bound, x.dtype)

            def fn(dw=dw):
                return F.linear(x, dw)

            h, wl, gr = host_us(fn), wall_us(fn), graph_us(fn)
            op = host_us(lambda args=args: dmm.decode_mm(*args))
            with through_dispatcher():
                via = host_us(lambda args=args: dmm.decode_mm(*args))
            cuda_fn = host_us(lambda args=args: dmm.cuda(*args))
            cpp = host_us(lambda args=args: dmm._launch(*args))
            emit(f"| {name} weight-only | {h:.1f} | {wl:.1f} | {gr:.1f} | {bf16_wall / wl:.2f}x | "
                 f"{op:.1f} | {via:.1f} | {cuda_fn:.1f} | {cpp:.1f} |")


def cuda_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def cpu_ms(fn, reps: int = 11) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile(fn, calls: int = 300, top: int = 30) -> None:
    """cProfile of `calls` calls: where the host time goes, by own time."""
    import cProfile
    import io
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue())


def from_hp_section(device: str) -> None:
    shape = (16384, 8192) if device == "cuda" else (4096, 4096)
    x = torch.randn(shape, device=device).bfloat16()
    timer = cuda_ms if device == "cuda" else cpu_ms
    emit(f"\n### from_hp on {device}, {shape[0]}x{shape[1]} bf16\n")
    emit("| format | default ms | check_finite=False ms | ratio |")
    emit("|---|---|---|---|")
    for name, make in (("NVFP4", NVFP4Tensor.from_hp), ("MXFP8", MXFP8Tensor.from_hp),
                       ("NVFP4 columnwise RHT", lambda x, **kw: NVFP4Tensor.from_hp(
                           x, columnwise=True, rht=True, **kw))):
        on = timer(lambda: make(x))
        off = timer(lambda: make(x, check_finite=False))
        emit(f"| {name} | {on:.3f} | {off:.3f} | {on / off:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="markdown file for the tables")
    p.add_argument("--cpu-only", action="store_true", help="only the CPU from_hp section")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the NVFP4 weight-only call and from_hp (printed)")
    args = p.parse_args()
    if args.profile:
        w = NVFP4Tensor.from_hp(torch.randn(8192, 8192, device="cuda").bfloat16())
        x = torch.randn(1, 8192, device="cuda").bfloat16()
        with torch.no_grad():
            profile(lambda: F.linear(x, w))
        big = torch.randn(16384, 8192, device="cuda").bfloat16()
        profile(lambda: NVFP4Tensor.from_hp(big), calls=50)
    date = datetime.date.today().isoformat()
    if not args.cpu_only:
        emit(f"## Host overhead, {date}, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}")
        for m in (1, 16):
            linear_section(8192, 8192, m)
        from_hp_section("cuda")
    else:
        emit(f"## from_hp check cost, {date}, CPU ({os.cpu_count()} cores), torch "
             f"{torch.__version__}")
    from_hp_section("cpu")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(ROWS) + "\n")


if __name__ == "__main__":
    main()
