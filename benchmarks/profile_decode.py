"""Where a decode token's GPU time goes: the kernels of compiled (or eager) greedy decoding with a
static KV cache, per token, for bf16 and each qtensor config of bench_decode.py.

Run on one GPU:
    python benchmarks/profile_decode.py [--configs bf16,nvfp4_weight_only] [--eager] [--top 20]
For each config: generate() twice as a warm-up (compilation, CUDA graph capture), then once
under torch.profiler. It prints the kernels sorted by their total GPU time, divided by the new
tokens (the prefill is one forward among them, so a kernel seen once is most likely the
prefill's), and the host-side ops that launched the most. With TORCH_LOGS=cudagraphs the CUDA
graph trees also say when they record again and why.

With --freezing, Inductor compiles with its freezing option: in inference the parameters, the
quantized weights included, become constants of the compiled graph instead of its inputs.
generate() is then given one StaticCache for all its calls (a frozen graph keeps the cache it
was compiled with).

With --loop it profiles greedy decoding by one-token steps without generate() instead
(`GreedyLoop` of bench_decode.py: compiled with mode "reduce-overhead", or with freezing too
under --freezing, or frozen with qtensor.FuseDecodeProducts under --fused; --eager for the eager
loop). Each table ends with the GPU time per token split into the weights' products (the decode
GEMM, cuBLAS and the dense quantized GEMM kernels) and everything else (attention, norms, the
fused elementwise kernels): the rest is what a faster weight format cannot shorten.

With --host it profiles the host instead: cProfile around one generate() call, the Python
functions by their own time per new token, and by their cumulative time (where the host time
of a token goes between the compiled calls, the guards and the CUDA graph replays).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))

import bench_decode  # noqa: E402
from bench_decode import GreedyLoop, decode_ms_per_token, generate, kept_cache  # noqa: E402


def host_profile(decode, name: str, tokens: int, top: int) -> None:
    """cProfile of decode() (`tokens` new tokens), per token."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    decode()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = list(stats.stats.items())  # (file, line, function): (cc, calls, own, cumulative, _)
    total = sum(v[2] for _, v in rows)
    print(f"\n### {name}: host profile of its decoding, {tokens} new tokens: "
          f"{total / tokens * 1e6:.0f} us of Python-visible time per token")
    for title, col in (("own time", 2), ("cumulative time", 3)):
        print(f"| function ({title}) | calls / token | us / token |")
        print("|---|---|---|")
        for (file, line, fn), v in sorted(rows, key=lambda r: -r[1][col])[:top]:
            where = f"{os.path.basename(os.path.dirname(file))}/{os.path.basename(file)}:{line}"
            print(f"| {fn[:50]} {where} | {v[1] / tokens:.1f} | {v[col] / tokens * 1e6:.1f} |")


# Kernel names of the weights' products, lowercased: the decode GEMM and the dense quantized
# GEMMs (Triton, named after their ops), cuBLAS / CUTLASS GEMMs of bf16 weights (and the lm_head)
# with cuBLAS's split-K reductions (splitKreduce_kernel), Inductor's mm templates. Inductor's
# pointwise and reduction kernels are named after every op they fuse (the silu after a
# decode_mm is "triton_poi_fused_..._decode_mm_mul_silu_..."): never products.
_PRODUCT_KERNELS = ("gemm", "splitk", "sm90_xmma", "cutlass", "nvjet", "_mm_", "addmm")
_FUSED_ELEMENTWISE = ("triton_poi_", "triton_red_", "triton_per_")


def is_product_kernel(name: str) -> bool:
    name = name.lower()
    if name.startswith(_FUSED_ELEMENTWISE):
        return False
    return any(k in name for k in _PRODUCT_KERNELS)


def profile_config(name: str, layers: int, tokens: int, compiled: bool, top: int,
                   host: bool = False, loop: str | None = None, frozen: bool = False) -> None:
    """Profile `name`'s decoding: generate() (compiled with freezing where `frozen`), or with
    `loop` a GreedyLoop of that mode."""
    model = bench_decode.fresh_model(layers, name)
    device = model.lm_head.weight.device
    ids = torch.randint(0, model.config.vocab_size, (1, 32), device=device,
                        generator=torch.Generator(device).manual_seed(2))
    if loop is None:
        cache = kept_cache(model, ids, max(16 + 32, tokens)) if frozen else None
        ms, _ = decode_ms_per_token(model, ids, compiled, 32, cache)  # also the warm-up
        generate(model, ids, tokens, compiled, cache)
        torch.cuda.synchronize()
        how = f"generate(), {'frozen' if frozen else 'compiled' if compiled else 'eager'}"

        def decode():
            generate(model, ids, tokens, compiled, cache)
    else:
        greedy = GreedyLoop(model, ids, loop, 3 + 32 + tokens)  # warm-up, timing, profile
        greedy.run(3)  # compiles, captures
        ms = greedy.run(32) / 32 * 1e3
        how = f"greedy loop, {loop}"

        def decode():
            greedy.run(tokens)
    print(f"\n{name}: {ms * 1e3:.0f} us/token wall ({how})")
    if host:
        host_profile(decode, name, tokens, top)
        del model
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                 key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in gpu)
    print(f"\n### {name}, {how}: {ms * 1e3:.0f} us/token wall (32 tokens); "
          f"profiled {tokens} new tokens: GPU busy {total / tokens:.0f} us/token")
    print("| kernel | calls | us total / token | us each |")
    print("|---|---|---|---|")
    for e in gpu[:top]:
        print(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / tokens:.1f} | "
              f"{e.self_device_time_total / e.count:.1f} |")
    products = sum(e.self_device_time_total for e in gpu if is_product_kernel(e.key))
    print(f"\nper token: products of the weights {products / tokens:.0f} us, the rest "
          f"{(total - products) / tokens:.0f} us (of {total / tokens:.0f} us GPU busy)")
    cpu = sorted((e for e in events if e.count >= tokens), key=lambda e: -e.cpu_time_total)
    print("\nhost events called at least once per token, by host time per token: "
          + ", ".join(f"{e.key[:60]} x{e.count} {e.cpu_time_total / tokens:.0f} us"
                      for e in cpu[:14]))
    del model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="bf16,nvfp4_weight_only")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="profile eager decoding instead")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--host", action="store_true", help="profile the host (cProfile) instead")
    p.add_argument("--loop", action="store_true",
                   help="profile greedy decoding by one-token steps instead of generate()")
    p.add_argument("--fused", action="store_true",
                   help="with --loop: frozen with qtensor.FuseDecodeProducts")
    p.add_argument("--freezing", action="store_true",
                   help="compile with Inductor's freezing (the weights become graph constants)")
    args = p.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.freezing = args.freezing
    for name in args.configs.split(","):
        loop = None
        if args.loop:
            loop = "eager" if args.eager else \
                "fused" if args.fused else "frozen" if args.freezing else "compiled"
        profile_config(name, args.layers, args.tokens, not args.eager, args.top, args.host,
                       loop, frozen=args.freezing and not args.eager)


if __name__ == "__main__":
    main()
