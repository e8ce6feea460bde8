"""What a quantized weight costs the host in each call of a compiled decode step, on the CPU.

    python dev/experiments/compiled_host.py [--layers 4] [--steps 60] [--repeats 7]
    python dev/experiments/compiled_host.py --generate-freezing
    python dev/experiments/compiled_host.py --eager [--layers 4] [--steps 40] [--repeats 5]

A small Llama (hidden 64, 7 linear layers a decoder layer) decodes by one-token steps
(`GreedyLoop` of benchmarks/bench_decode.py), the step compiled by Inductor (fullgraph), for
bf16 weights and for NVFP4 and MXFP8 weights in the decode layout (DecodeWeight), each compiled
plainly and with Inductor's freezing. The decode op's CPU kernel is replaced by one that returns
zeros, so that a step's time is the host's: the compiled call's guards, the unwrapping of its
tensor-subclass inputs, the launch of each op. It prints the median step time of each, and:

- per weight, input: (plain - frozen) / weights for a quantized config. The guards of a
  tensor-subclass input (its flatten context, compared by `__metadata_guard__`) and its
  unwrapping into inner tensors at every call. Freezing makes the weights constants of the
  graph, so neither runs; the op calls are the same in both. A CUDA-graphed step (mode
  "reduce-overhead") still pays this per call: guards and unwrapping run before the replay.
- per product fused: (frozen - fused) / products fused away, "fused" being frozen with
  qtensor.FuseDecodeProducts ([Note: fused decode products]: q/k/v and gate/up as one product
  each, 4 a layer instead of 7): what one product fewer saves the host of a step without CUDA
  graphs (on a GPU, a launch's fixed cost as well, which this cannot show).
- op call: one call of torch.ops.qtensor.decode_mm (its autograd wrapper, the redispatch to
  the kernel) less a direct call of the same stub kernel: what the op's Python path adds to
  each linear layer of a compiled step without CUDA graphs (a CUDA-graph replay does not run
  it).

--eager: the same loops run eagerly (no compile): per quantized weight, the eager step's host
time above bf16's (the tensor subclass's dispatch, the op's Python path and the stub kernel,
less bf16's F.linear, whose matmul at hidden 64 costs little). The C++ launch of the GPU op is
not in it (bench_overhead.py's decode-layout table times that on a GPU).

--generate-freezing: whether transformers' generate() decodes with its compiled forward under
Inductor's freezing, on a small fp32 Llama with plain weights, call after call: with a new
static cache each call (cache_implementation="static"), and given one StaticCache reset
between calls (what bench_decode.py's frozen column does).

Results, with date and torch version, in benchmarks/RESULTS.md ("the host side of a compiled
decode step"; for --eager, "what an eager decode step's quantized weights cost in Python") and
docs/decode.md ("Status").
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import bench_decode  # noqa: E402
import qtensor  # noqa: E402
from qtensor.ops import decode_mm  # noqa: E402

CONFIGS = {"bf16": None, "nvfp4 decode layout": qtensor.NVFP4WeightOnlyConfig,
           "mxfp8 decode layout": qtensor.MXFP8WeightOnlyConfig}
_STUB_LIB = []


def _zeros(x, w, s, amax, bias, fmt, n, k, bound, out_dtype):
    return x.new_zeros((x.shape[0], n), dtype=out_dtype)


def stub_decode_kernel() -> None:
    """qtensor::decode_mm's CPU kernel replaced by `_zeros` (the registry of Python overrides is
    cleared first: torch 2.11 refuses a second Python kernel for one key, 2.13 warns)."""
    getattr(torch.library, "_impls", set()).discard("qtensor/decode_mm/CPU")
    lib = torch.library.Library("qtensor", "IMPL")
    lib.impl("decode_mm", _zeros, "CPU")
    _STUB_LIB.append(lib)  # the override lives as long as its library object
    decode_mm.KERNELS["cpu"] = _zeros


def build(layers: int, config):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if config is not None:
        qtensor.quantize_(model, config(layout="decode"),
                          filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head")
    return model


def generate_freezing() -> None:
    import torch._inductor.config as inductor_config
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    model = build(2, None).float()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only otherwise

    def generate(cache=None, **kw):
        if cache is None:
            kw["cache_implementation"] = "static"
        else:
            cache.reset()
            kw[bench_decode.cache_kwarg(model)] = cache
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, **kw)

    eager = generate(disable_compile=True)
    kept = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 13)
    for how, cache in (("a new static cache each call", None), ("one StaticCache", kept)):
        torch._dynamo.reset()
        with inductor_config.patch(freezing=True):
            for call in ("first", "second", "third"):
                label = f"generate() compiled with freezing, {how}, {call} call"
                try:
                    same = torch.equal(generate(cache, compile_config=compile_config), eager)
                    print(f"{label}: tokens equal eager's: {same}")
                except Exception as e:  # the finding itself
                    where = str(e).splitlines()[0].split(", ")[-1]  # the message, not the file
                    print(f"{label}: {type(e).__name__}: {where[-120:]}")


def eager(layers: int, steps: int, repeats: int) -> None:
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    us = {}
    for name, config in CONFIGS.items():
        loop = bench_decode.GreedyLoop(build(layers, config), ids, "eager", 3 + repeats * steps)
        loop.run(3)
        us[name] = min(loop.run(steps) / steps * 1e6 for _ in range(repeats))
    print(f"torch {torch.__version__}, {layers} layers ({7 * layers} quantized weights), eager, "
          f"the decode op stubbed; us a step, the fastest of {repeats} runs of {steps} steps")
    print("| weights | eager step us | per quantized weight above bf16 |")
    print("|---|---|---|")
    for name, t in us.items():
        per = "" if name == "bf16" else f"{(t - us['bf16']) / (7 * layers):.1f}"
        print(f"| {name} | {t:.0f} | {per} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--generate-freezing", action="store_true",
                   help="only check generate() compiled with freezing")
    p.add_argument("--eager", action="store_true", help="only the eager loops' host time")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.generate_freezing:
        generate_freezing()
        return
    stub_decode_kernel()
    if args.eager:
        eager(args.layers, args.steps, args.repeats)
        return
    weights = 7 * args.layers
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    models = {name: build(args.layers, config) for name, config in CONFIGS.items()}
    keys = [(name, mode) for name in CONFIGS for mode in ("compiled", "frozen", "fused")]
    # Each compiled step alone in Dynamo's cache (the loops share the step's code object, and a
    # call would first test the guards of the others' graphs). Two passes in opposite orders,
    # so that a shared machine's slow spell falls on all; the fastest run of each.
    us = {key: float("inf") for key in keys}
    for order in (keys, keys[::-1]):
        for name, mode in order:
            torch._dynamo.reset()
            loop = bench_decode.GreedyLoop(models[name], ids, mode, 3 + args.repeats * args.steps)
            loop.run(3)  # compiles
            for _ in range(args.repeats):
                us[(name, mode)] = min(us[(name, mode)], loop.run(args.steps) / args.steps * 1e6)
    print(f"torch {torch.__version__}, {args.layers} layers ({weights} quantized weights), "
          f"the decode op stubbed; us a step, the fastest of 2 x {args.repeats} runs of "
          f"{args.steps} steps")
    print("| weights | compiled | frozen | fused | per weight, input | per product fused |")
    print("|---|---|---|---|---|---|")
    for name, config in CONFIGS.items():
        inp = fused = ""
        if config is not None:
            inp = f"{(us[(name, 'compiled')] - us[(name, 'frozen')]) / weights:.1f}"
            # q/k/v and gate/up: 3 of a layer's 7 products fused away
            fused = f"{(us[(name, 'frozen')] - us[(name, 'fused')]) / (3 * args.layers):.1f}"
        print(f"| {name} | {us[(name, 'compiled')]:.0f} | {us[(name, 'frozen')]:.0f} | "
              f"{us[(name, 'fused')]:.0f} | {inp} | {fused} |")
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w, s = torch.zeros(64, 32, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8)
    op_args = (x, w, s, None, None, "mxfp8", 64, 64, 448, torch.bfloat16)
    with torch.no_grad():
        t_op = min(timeit.repeat(lambda: torch.ops.qtensor.decode_mm.default(*op_args),
                                 number=2000, repeat=5)) / 2000
        t_fn = min(timeit.repeat(lambda: _zeros(*op_args), number=2000, repeat=5)) / 2000
    print(f"\nop call: {(t_op - t_fn) * 1e6:.1f} us (torch.ops.qtensor.decode_mm "
          f"{t_op * 1e6:.1f} us, the kernel alone {t_fn * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
