"""End-to-end decode: a transformers Llama (hidden 4096, 8 layers, bf16 lm_head) built from a
config, greedy decoding with a static KV cache, bf16 against each qtensor config.

Run on one GPU (benchmarks/gpu_check.sh calls it):
    python benchmarks/bench_decode.py [--out LOGDIR/bench_decode.md] [--compiled CONFIGS]
        [--frozen CONFIGS] [--loop | --loop-only] [--step | --step-only] [--batches B]
        [--modes MODES]
or the loop table on the CPU (the CPU GEMM kernels): --device cpu --loop-only [--layers L].
For each config and batch size (1 and 8): decode tokens/s eager, compiled and compiled with
freezing, the prefill time of 2048 tokens, and the peak GPU memory. How it is measured:
- generate() with cache_implementation="static" and do_sample=False. transformers compiles the
  forward by itself when the cache is static; "eager" passes disable_compile=True so that eager
  means eager, "compiled" passes CompileConfig(fullgraph=True, mode="reduce-overhead") (CUDA
  graphs). The compiled rows report the graphs compiled, the graph breaks seen and the times
  Inductor skipped CUDA graphs (then the "compiled" row runs without them). "frozen" compiles
  the same way under Inductor's freezing (the weights become constants of the graph, so a
  call neither guards nor unwraps them), generate() given one StaticCache for all its calls
  (reset before each): with a new cache each call, a frozen graph, which keeps the cache it
  was compiled with, fails at the second call.
- Decode time per token is the difference of two generate() calls (16 and 16 + N new tokens)
  over N, which cancels the prefill and the setup; tokens/s = batch / time per token. Each
  measurement follows a warm-up call (compilation, CUDA graph capture).
- bf16 is measured twice and the second is the baseline: the first pays the process warm-up.
- The prefill is one forward of [1, 2048] tokens without cache (eager, median of 3).
- Peak memory is the most allocated during the config's runs above what was allocated before
  its model was built (weights, KV cache, workspaces, CUDA graph pools).
- Every config's first greedy tokens, compiled and frozen, are compared with eager's own:
  for a quantized config they run the same kernels, so they must agree.
- The step table (--step) times one decode step without generate()'s host loop: the forward of
  one token per sequence (without a KV cache), captured in a CUDA graph and replayed, once as
  eager kernels and once compiled by Inductor (which fuses the norms, rotary and residual adds
  around the linear layers, as the compiled decode does); its GPU time per token is what the
  weight formats change. A third time compiles it with freezing and qtensor.FuseDecodeProducts
  ("fused": q/k/v and gate/up as one decode product each). Its last column is the layers'
  linear layers alone (each module of layer 0 replayed from a CUDA graph, times the layers).
- The loop table (--loop, or --loop-only; --batches and --modes pick its batch sizes and
  modes) times greedy decoding without generate(): a static KV cache, one eager prefill,
  then one-token steps (the model's forward on the cache) and an argmax, each step fed the
  last one's token on the device, with no host sync between steps (the loop of gpt-fast and
  of torchao's generation benchmark). The step runs eager, compiled (fullgraph,
  mode="reduce-overhead"), compiled with Inductor's freezing, which makes the weights
  constants of the graph: a compiled call then neither guards nor unwraps the quantized
  weights (tensor subclasses), which on torch 2.11 costs about 11 us of host time a weight
  and a step on the development machine's CPU (dev/experiments/compiled_host.py), and
  "fused": frozen with qtensor.FuseDecodeProducts as well, so that the quantized products
  that share their activation (q/k/v, gate/up) run as one launch each, 4 a layer instead of 7
  (bf16's "fused" is its "frozen": Inductor's freezing already concatenates plain weights of
  equal shapes). Tokens/s = batch x steps / the time of `steps` steps, the median of three
  runs after three warm-up steps; bf16 is timed the same way for each mode. The tokens of
  each compiled loop are compared with the eager loop's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import qtensor  # noqa: E402

ROWS: list[str] = []
DEVICE = "cuda"  # --device: "cpu" runs the loop table on the CPU kernels
CONFIGS = {
    "nvfp4_weight_only": lambda: qtensor.NVFP4WeightOnlyConfig(),
    "mxfp8_weight_only": lambda: qtensor.MXFP8WeightOnlyConfig(),
    "mxfp4_weight_only": lambda: qtensor.MXFP4WeightOnlyConfig(),
    "nvfp4_dynamic": lambda: qtensor.NVFP4DynamicActivationNVFP4WeightConfig(),
    "mxfp8_dynamic": lambda: qtensor.MXFP8DynamicActivationMXFP8WeightConfig(),
}


def emit(line: str) -> None:
    print(line, flush=True)
    ROWS.append(line)


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def quantize(model, name: str):
    """The model with `name`'s weights, as a user would set it up for decoding: sibling
    quantized weights share one buffer per field (qtensor.share_decode_storage), so that the
    "fused" mode's products are views of the model's bytes."""
    if name.startswith("bf16"):
        return model
    qtensor.quantize_(model, CONFIGS[name](),
                      filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head")
    qtensor.share_decode_storage(model)
    return model


def fresh_model(layers: int, name: str):
    """The model of config `name`, built once the previous one's compiled code and memory are
    released (the caller drops its model first)."""
    torch._dynamo.reset()
    gc.collect()
    empty_cache()
    return quantize(build_model(layers), name)


def cache_kwarg(model) -> str:
    """The forward's (and generate()'s) name for the KV cache: later transformers 5.x releases
    rename `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


def generate(model, ids, new_tokens: int, compiled: bool, cache=None):
    """generate() of `new_tokens` greedy tokens on a static KV cache: a new one each call, or
    `cache` (a StaticCache the caller keeps; reset here), which compiling with Inductor's
    freezing needs (a frozen graph keeps the cache it was compiled with)."""
    from transformers.generation import CompileConfig

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0)
    if cache is None:
        kw["cache_implementation"] = "static"
    else:
        cache.reset()
        kw[cache_kwarg(model)] = cache
    if compiled:
        kw["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    else:
        kw["disable_compile"] = True
    with torch.no_grad():
        return model.generate(ids, **kw)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def kept_cache(model, ids, new_tokens: int):
    """A StaticCache for `new_tokens` after the prompt `ids`, kept for every call of a compiled
    step or generate(): a graph compiled with freezing keeps the cache it was compiled with."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)


def decode_ms_per_token(model, ids, compiled: bool, steps: int,
                        cache=None) -> tuple[float, torch.Tensor]:
    """ms a decoded token by generate(), eager or compiled; given `cache` (a kept_cache of at
    least 16 + steps tokens), compiled with Inductor's freezing on it. And the longer call's
    tokens."""
    import torch._inductor.config as inductor_config

    short, long_ = 16, 16 + steps
    frozen = cache is not None
    compiled = compiled or frozen

    def run(n):
        return generate(model, ids, n, compiled, cache)

    with inductor_config.patch(freezing=frozen):
        out = run(long_)  # warm-up: compile and capture both lengths
        run(short)
        t_long = statistics.median(timed(lambda: run(long_)) for _ in range(3))
        t_short = statistics.median(timed(lambda: run(short)) for _ in range(3))
    return (t_long - t_short) / steps * 1e3, out


def prefill_ms(model, tokens: int = 2048) -> float:
    ids = torch.randint(0, 32000, (1, tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        model(ids, use_cache=False)
        return statistics.median(timed(lambda: model(ids, use_cache=False)) for _ in range(3)) * 1e3


def graph_us(fn, reps: int = 50) -> float:
    """Median microseconds of fn replayed from a CUDA graph (warm-up calls first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def step_us(model, batch: int) -> dict[str, float | str]:
    """GPU time of one token per sequence through the model (no KV cache: attention over that
    token only, which at decode lengths of a few hundred is a small part of a step), as eager
    kernels, compiled by Inductor (default mode: the CUDA graph is this function's), and
    compiled with freezing and qtensor.FuseDecodeProducts ("fused"), each replayed from a CUDA
    graph; a way that cannot be captured gives its error instead."""
    import torch._inductor.config as inductor_config

    tok = torch.randint(0, 32000, (batch, 1), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(3))
    out: dict[str, float | str] = {}
    with torch.no_grad():
        for how in ("eager", "compiled", "fused"):
            fwd = model.forward if how == "eager" else torch.compile(model.forward, fullgraph=True)
            torch._dynamo.reset()
            try:
                with inductor_config.patch(**inductor_patch(how)):  # compiled at the first call
                    out[how] = graph_us(lambda fwd=fwd: fwd(input_ids=tok, use_cache=False))
            except Exception as e:  # a capture that syncs: reported in the table
                out[how] = f"{type(e).__name__}: {str(e)[:60]}"
                torch.cuda.synchronize()
    return out


def linears_us(model, batch: int) -> float:
    """GPU time of one token's pass through every decoder layer's linear layers."""
    layer = model.model.layers[0]
    total = 0.0
    for mod in layer.modules():
        if isinstance(mod, torch.nn.Linear):
            x = torch.randn(batch, mod.in_features, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                total += graph_us(lambda mod=mod, x=x: mod(x))
    return total * len(model.model.layers)


LOOP_MODES = ("eager", "compiled", "frozen", "fused")


def inductor_patch(mode: str) -> dict:
    """The Inductor settings of a compiled mode: freezing for "frozen" and "fused", and
    FuseDecodeProducts as the post-grad pass for "fused" (set where the step first runs:
    Dynamo reads `freezing` while it traces)."""
    return {"freezing": mode in ("frozen", "fused"),
            "post_grad_custom_post_pass": qtensor.FuseDecodeProducts() if mode == "fused" else None}


class GreedyLoop:
    """Greedy decoding of `ids` [batch, prompt] by one-token steps on a static KV cache of
    prompt + `max_new` positions: the prefill (eager) at construction, then `run(n)` decodes n
    more tokens. The step runs eager, compiled ("compiled": fullgraph, mode "reduce-overhead",
    so CUDA graphs where the device has them), compiled with Inductor's freezing ("frozen"),
    or frozen with qtensor.FuseDecodeProducts as well ("fused": the decode products that share
    their activation run as one, [Note: fused decode products]).
    Each step is fed the last step's token on the device; the host waits for the device only at
    the end of `run`. `tokens()` is what it decoded: the prefill's token, then every step's."""

    def __init__(self, model, ids: torch.Tensor, mode: str, max_new: int):
        if mode not in LOOP_MODES:
            raise ValueError(f"GreedyLoop: mode is one of {LOOP_MODES}; got {mode!r}.")
        self.mode = mode
        kw = {cache_kwarg(model): kept_cache(model, ids, max_new + 1), "use_cache": True,
              "logits_to_keep": 1}

        def step(tok):
            return model(tok, **kw).logits[:, -1:].argmax(-1)

        self.step = step if mode == "eager" else \
            torch.compile(step, fullgraph=True, mode="reduce-overhead")
        self.sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        with torch.no_grad():
            self.out = [model(ids, **kw).logits[:, -1:].argmax(-1)]  # the prefill

    def run(self, n: int) -> float:
        """Decode n tokens; the seconds they took."""
        import torch._inductor.config as inductor_config

        tok = self.out[-1]
        with torch.no_grad(), inductor_config.patch(**inductor_patch(self.mode)):
            self.sync()
            start = time.perf_counter()
            for _ in range(n):
                # a clone: a CUDA graph's output is overwritten by its next replay
                tok = self.step(tok).clone()
                self.out.append(tok)
            self.sync()
        return time.perf_counter() - start

    def tokens(self) -> torch.Tensor:
        return torch.cat(self.out, dim=1)


def greedy_loop(model, ids: torch.Tensor, steps: int, mode: str, warmup: int = 3,
                repeats: int = 3) -> tuple[float, torch.Tensor]:
    """A GreedyLoop's `warmup` steps (compilation, CUDA graph capture), then `repeats` runs of
    `steps` steps: (the median seconds of a run, the tokens decoded)."""
    loop = GreedyLoop(model, ids, mode, warmup + repeats * steps)
    loop.run(warmup)
    seconds = statistics.median(loop.run(steps) for _ in range(repeats))
    return seconds, loop.tokens()


def emit_table(title: str, columns: list[str]) -> None:
    """A table's title and header rows."""
    emit(f"\n### {title}\n")
    emit("| " + " | ".join(columns) + " |")
    emit("|" + "---|" * len(columns))


def config_names(args) -> list[str]:
    """bf16, then each config of --configs."""
    return ["bf16"] + [c for c in args.configs.split(",") if c]


def loop_modes(text: str) -> tuple[str, ...]:
    """The loop table's modes from --modes: eager first (the tokens' reference), then the
    others named, in LOOP_MODES's order."""
    named = {m for m in text.split(",") if m}
    unknown = named - set(LOOP_MODES)
    if unknown:
        raise SystemExit(f"--modes takes {', '.join(LOOP_MODES)}; got {', '.join(sorted(unknown))}")
    return tuple(m for m in LOOP_MODES if m == "eager" or m in named)


def loop_table(args) -> None:
    modes = loop_modes(args.modes)
    columns = [c for m in modes for c in (f"{m} tok/s", "vs bf16")]
    emit_table(f"Greedy decoding by one-token steps, without generate(), {args.layers} layers, "
               f"{args.steps} timed steps",
               ["config", "batch", *columns, f"tokens agree ({', '.join(modes[1:])})"])
    base: dict[tuple[int, str], float] = {}
    for name in config_names(args):
        model = fresh_model(args.layers, name)
        device = model.lm_head.weight.device
        for batch in (int(b) for b in args.batches.split(",")):
            ids = torch.randint(0, model.config.vocab_size, (batch, 32), device=device,
                                generator=torch.Generator(device).manual_seed(2))
            cells, tokens = [], {}
            for mode in modes:
                torch._dynamo.reset()
                try:
                    seconds, tokens[mode] = greedy_loop(model, ids, args.steps, mode)
                except Exception as e:  # reported in the table, the sweep goes on
                    cells += [f"{type(e).__name__}: {str(e)[:60]}", ""]
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    continue
                tok_s = batch * args.steps / seconds
                if name == "bf16":
                    base[(batch, mode)] = tok_s
                ratio = tok_s / base[(batch, mode)] if (batch, mode) in base else None
                cells += [f"{tok_s:.0f}", f"{ratio:.2f}x" if ratio else ""]
            agree = ", ".join(str(torch.equal(tokens[m], tokens["eager"])) if m in tokens and
                              "eager" in tokens else "-" for m in modes[1:])
            emit(f"| {name} | {batch} | {' | '.join(cells)} | {agree} |")
        del model
        empty_cache()


def step_table(args) -> None:
    emit_table(f"One decode step from a CUDA graph (no generate() loop), {args.layers} layers",
               ["config", "batch", "eager step us", "vs bf16", "compiled step us", "tok/s",
                "vs bf16", "fused step us", "vs bf16", "linears us", "vs bf16"])
    base: dict[tuple[int, str], float] = {}
    for name in config_names(args):
        model = fresh_model(args.layers, name)
        for batch in (1, 8):
            try:
                steps = step_us(model, batch)
                steps["linears"] = linears_us(model, batch)
            except Exception as e:  # reported in the table, the sweep goes on
                emit(f"| {name} | {batch} | {type(e).__name__}: {str(e)[:80]} | | | | | | | | |")
                continue
            cells = {}
            for how, us in steps.items():
                if isinstance(us, str):
                    cells[how] = (us, "")
                    continue
                if name == "bf16":
                    base[(batch, how)] = us
                cells[how] = (f"{us:.0f}", f"{base.get((batch, how), float('nan')) / us:.2f}x")
            comp = steps["compiled"]
            tok_s = f"{batch / comp * 1e6:.0f}" if isinstance(comp, float) else ""
            emit(f"| {name} | {batch} | {' | '.join(cells['eager'])} | {cells['compiled'][0]} | "
                 f"{tok_s} | {cells['compiled'][1]} | {' | '.join(cells['fused'])} | "
                 f"{' | '.join(cells['linears'])} |")
        del model
        empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="markdown file for the table")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per measurement")
    p.add_argument("--configs", default=",".join(CONFIGS), help="quantized configs to run")
    p.add_argument("--compiled", default=",".join(["bf16"] + list(CONFIGS)),
                   help="configs also measured compiled (each compile takes a minute)")
    p.add_argument("--frozen", default="bf16,nvfp4_weight_only,mxfp8_weight_only,mxfp4_weight_only",
                   help="configs also measured compiled with Inductor's freezing, generate() "
                        "given one static cache for all its calls")
    p.add_argument("--step", action="store_true", help="also time one CUDA-graphed decode step")
    p.add_argument("--step-only", action="store_true", help="only the step table")
    p.add_argument("--loop", action="store_true",
                   help="also time greedy decoding by one-token steps, without generate()")
    p.add_argument("--loop-only", action="store_true", help="only the loop table")
    p.add_argument("--batches", default="1,8", help="batch sizes of the loop table")
    p.add_argument("--modes", default=",".join(LOOP_MODES),
                   help="the loop table's modes besides eager (compiled, frozen, fused)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the loop table alone (--loop-only), on the CPU kernels")
    args = p.parse_args()
    import transformers
    from torch._dynamo.utils import counters

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu" and not args.loop_only:
        raise SystemExit("--device cpu runs the loop table alone: pass --loop-only (generate() "
                         "and the step table time CUDA graphs).")
    date = datetime.date.today().isoformat()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else \
        f"CPU x{torch.get_num_threads()} threads"
    emit(f"## Decode, {date}, {where}, torch {torch.__version__}, "
         f"transformers {transformers.__version__}")
    emit(f"Llama hidden 4096, intermediate 14336, {args.layers} layers, 32/8 heads, vocab "
         f"32000, bf16 lm_head; prompt 32 tokens; {args.steps} timed decode steps\n")
    if args.step_only or args.loop_only:
        if args.step_only:
            step_table(args)
        if args.loop_only:
            loop_table(args)
        names = []
    else:
        names = ["bf16_first"] + config_names(args)
    if names:
        emit("| config | batch | eager tok/s | vs bf16 | compiled tok/s | vs bf16 "
             "| graphs, breaks, cudagraph skips | frozen tok/s | vs bf16 "
             "| prefill 2048 ms | peak GiB | tokens agree (compiled, frozen) |")
        emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    compiled_set = set(args.compiled.split(",")) if args.compiled else set()
    frozen_set = set(args.frozen.split(",")) if args.frozen else set()
    base: dict[tuple[int, str], float] = {}
    for name in names:
        torch._dynamo.reset()
        gc.collect()
        empty_cache()
        start_bytes = torch.cuda.memory_allocated()
        model = quantize(build_model(args.layers), name)
        torch.cuda.reset_peak_memory_stats()
        pre = prefill_ms(model)
        for batch in (1, 8):
            ids = torch.randint(0, 32000, (batch, 32), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(2))
            row = {}
            try:
                ms, eager_out = decode_ms_per_token(model, ids, False, args.steps)
                row["eager"] = batch / ms * 1e3
            except Exception as e:  # reported in the table, the sweep goes on
                row["eager_err"] = f"{type(e).__name__}: {str(e)[:60]}"
                eager_out = None
            agree = {}
            for mode, chosen in (("compiled", compiled_set), ("frozen", frozen_set)):
                if ("bf16" if name.startswith("bf16") else name) not in chosen:
                    continue
                torch._dynamo.reset()
                counters.clear()
                try:
                    cache = kept_cache(model, ids, 16 + args.steps) if mode == "frozen" \
                        else None
                    ms, comp_out = decode_ms_per_token(model, ids, True, args.steps, cache)
                    row[mode] = batch / ms * 1e3
                    if mode == "compiled":
                        row["graphs"] = (f"{counters['stats']['unique_graphs']}, "
                                         f"{sum(counters['graph_break'].values())}, "
                                         f"{counters['inductor']['cudagraph_skips']}")
                    if eager_out is not None:
                        agree[mode] = torch.equal(comp_out[:, :48], eager_out[:, :48])
                except Exception as e:  # reported in the table, the sweep goes on
                    row[mode + "_err"] = f"{type(e).__name__}: {str(e)[:60]}"
            for mode in ("eager", "compiled", "frozen"):
                if name == "bf16" and mode in row:
                    base[(batch, mode)] = row[mode]

            def cell(mode):
                if mode in row:
                    ratio = row[mode] / base[(batch, mode)] if (batch, mode) in base else None
                    return f"{row[mode]:.0f}", (f"{ratio:.2f}x" if ratio else "")
                return row.get(mode + "_err", "-"), ""

            e, er = cell("eager")
            c, cr = cell("compiled")
            f, fr = cell("frozen")
            peak = (torch.cuda.max_memory_allocated() - start_bytes) / 2**30
            agrees = ", ".join(str(agree[m]) if m in agree else "-" for m in ("compiled", "frozen"))
            emit(f"| {name} | {batch} | {e} | {er} | {c} | {cr} | {row.get('graphs', '')} | "
                 f"{f} | {fr} | {pre:.1f} | {peak:.1f} | {agrees} |")
        del model
        empty_cache()
    if args.step and not args.step_only:
        step_table(args)
    if args.loop and not args.loop_only:
        loop_table(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(ROWS) + "\n")


if __name__ == "__main__":
    main()
