"""Training step time of every recipe against bf16, ratios from one run (the training-speed goals).

Sections (`--sections`, default all but `backward`):
  layer     a Llama-8B-like decoder layer (hidden 4096, 32 heads / 8 KV heads, SwiGLU 14336) on
            8192 tokens (4 x 2048): forward, backward and an SGD update (so the weights are
            quantized again each step), eager and compiled (fullgraph), bf16 weights
  gpt       the small byte-level GPT of the study (width 512, 6 layers, 8192 tokens a step, fp32
            masters under bf16 autocast, AdamW), eager, eager with the backward run in the
            calling thread (autograd's multithreading off: no hand-off to the engine's device
            thread), compiled, compiled with the backward in the calling thread, and compiled
            with mode="reduce-overhead" (CUDA graphs: at this width a step is host-bound)
  moe       Qwen3-30B-A3B-like experts (128 experts, top-8: 65536 routed tokens, 2048 -> 768 x 2
            -> 2048, SwiGLU) through GroupedLinear, against bf16 torch._grouped_mm
  qat       MXFP4 weight QAT on both hosts (MXFP8, FP8 128x128) on the layer's SwiGLU MLP
  gemm      the GEMMs alone at M >= 4096 (NVFP4 x NVFP4, MXFP8 x MXFP8, activation and weight
            quantized before timing) against bf16 cuBLAS
  backward  (RL forward settings) quantize(dY) + dgrad + wgrad per linear, side by side
  host      the host time of one training linear's step (forward, backward, a weight update)
            on a layer too small for its kernels to matter (64 x 64, 64 tokens): what a small
            model's eager step pays per quantized linear; runs on the CPU too (--device cpu)
Recipes: nvfp4 (the default: 2D weights, RHT, SR), dgrad_mxfp8, 4over6 (all roles, no RHT),
4over6_grad, row_scaled, hp_bwd (backward_override="high_precision").

Timing: CUDA events around each step, median of --iters after --warmup steps, warm L2.
Run on the GPU machine: python benchmarks/bench_training.py --out results.json [--md table.md]
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import RL_FORWARD as RL
from _common import cuda_time_ms, mxfp8_backward_specs

from qtensor.training import NVFP4TrainingRecipe, TrainingLinear
from qtensor.training.roles import dgrad, quantize_role, wgrad

SHAPES = {  # name: (tokens, in_features, out_features)
    "qwen3-8b gate_up": (16384, 4096, 24576),
    "qwen3-8b down": (16384, 12288, 4096),
    "deepseek-v3 expert fc1": (8192, 7168, 4096),
    "deepseek-v3 expert fc2": (8192, 2048, 7168),
    "qwen3-30b-a3b expert fc1": (8192, 2048, 1536),
    "qwen3-30b-a3b expert fc2": (8192, 768, 2048),
}


SPECS = {
    "mxfp8": mxfp8_backward_specs(NVFP4TrainingRecipe(**RL)),
    "nvfp4": NVFP4TrainingRecipe(**RL).operand_specs(),
    "dgrad_mxfp8": NVFP4TrainingRecipe(dgrad_mxfp8=True, **RL).operand_specs(),
}


def backward_times(x, w, dy, warmup, iters) -> dict:
    bf = torch.bfloat16
    res = {"bf16": {"dgrad_ms": cuda_time_ms(lambda: dy @ w, warmup, iters),
                    "wgrad_ms": cuda_time_ms(lambda: dy.t() @ x, warmup, iters)}}
    for name, specs in SPECS.items():
        x_op = quantize_role(x, specs.input, "input")
        w_op = quantize_role(w, specs.weight, "weight")
        dy_op = quantize_role(dy, specs.grad_output, "grad_output")
        res[name] = {
            "quant_dy_ms": cuda_time_ms(
                lambda: quantize_role(dy, specs.grad_output, "grad_output"), warmup, iters),
            "quant_w_ms": cuda_time_ms(lambda: quantize_role(w, specs.weight, "weight"),
                                       warmup, iters),
            "dgrad_ms": cuda_time_ms(lambda: dgrad(dy_op, w_op, bf), warmup, iters),
            "wgrad_ms": cuda_time_ms(lambda: wgrad(dy_op, x_op, bf), warmup, iters),
            "backend": getattr(getattr(w_op, "rowwise", w_op), "gemm_backend", "?"),
        }
    for r in res.values():
        r["bwd_ms"] = r.get("quant_dy_ms", 0.0) + r["dgrad_ms"] + r["wgrad_ms"]
    return res


def linear_times(t, k, n, warmup, iters) -> dict:
    x = (torch.randn(t, k, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    dy = (torch.randn(t, n, device="cuda") * 1e-3).to(torch.bfloat16)
    out = {}
    mods = {"bf16": torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)}
    for name, kw in (("nvfp4", {}), ("dgrad_mxfp8", {"dgrad_mxfp8": True})):
        mods[name] = TrainingLinear(k, n, bias=False, recipe=NVFP4TrainingRecipe(**RL, **kw),
                                    device="cuda", dtype=torch.bfloat16)
    for name, mod in mods.items():
        out[name] = cuda_time_ms(lambda: mod(x).backward(dy), warmup, iters)
    return out


RECIPES = {
    "nvfp4": {},
    "dgrad_mxfp8": {"dgrad_mxfp8": True},
    "4over6": {"fourover6_roles": "all", "rht": False},
    "4over6_grad": {"fourover6_roles": "all", "fourover6_grad": True, "rht": False,
                    "stochastic_rounding": False},
    "row_scaled": {"row_scaled_activation": True, "rht": False, "weight_2d": False,
                   "stochastic_rounding": False},
    "hp_bwd": {"backward_override": "high_precision"},
}


def step_ms(step, warmup, iters) -> float:
    return cuda_time_ms(step, warmup, iters)


def sgd_step(model, loss_fn):
    """forward + backward + an in-place update (bumps each weight's version: the next forward
    quantizes it again, as after an optimizer step)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        loss_fn(model).backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-1e-6)
                p.grad = None
    return step


def quantized_copy(model, recipe_kw, filter_fn=None):
    import copy

    from torchao.quantization import quantize_

    from qtensor.training import TrainingConfig

    m = copy.deepcopy(model)
    quantize_(m, TrainingConfig(NVFP4TrainingRecipe(**recipe_kw)), filter_fn=filter_fn)
    return m


def rows_of(name, build, loss_of, recipes, compiled, warmup, iters, filter_fn=None):
    """{config: {eager_ms, compiled_ms}} for bf16 and each recipe of a model."""
    out = {}
    base = build()
    for cfg in ["bf16", *recipes]:
        model = base if cfg == "bf16" else quantized_copy(base, RECIPES[cfg], filter_fn)
        r = {"eager_ms": step_ms(sgd_step(model, loss_of), warmup, iters)}
        if cfg in compiled:
            torch._dynamo.reset()
            cm = torch.compile(model, fullgraph=True)
            r["compiled_ms"] = step_ms(sgd_step(cm, loss_of), warmup + 2, iters)
        out[cfg] = r
        print(f"{name:6s} {cfg:12s} " + " ".join(f"{k} {v:8.2f}" for k, v in r.items()), flush=True)
        if model is not base:
            del model
        torch.cuda.empty_cache()
    return out


def layer_section(recipes, compiled, warmup, iters):
    from qtensor.cli.models import Block, DemoConfig, rotary_tables

    cfg = DemoConfig(vocab_size=256, hidden=4096, layers=1, heads=32, kv_heads=8,
                     intermediate=14336)
    x = torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    cos, sin = rotary_tables(2048, cfg.head_dim, cfg.rope_theta, x.device)
    dy = torch.randn_like(x) * 1e-3

    def build():
        torch.manual_seed(0)
        return Block(cfg).to(device="cuda", dtype=torch.bfloat16)

    def loss(model):
        return (model(x, cos, sin) * dy).sum()
    return rows_of("layer", build, loss, recipes, compiled, warmup, iters)


GPT_CFG = dict(vocab_size=256, hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1408)


def gpt_step(name, mode="eager"):
    """One training step of the small GPT (bf16 or a recipe of RECIPES, every Linear but the
    head quantized): forward under bf16 autocast, cross-entropy, backward, AdamW. `mode`:
    "eager", or a torch.compile mode ("default", "reduce-overhead") for the model."""
    from qtensor.cli.models import DemoConfig, build_demo_model

    tokens = torch.randint(0, 256, (16, 513), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    torch.manual_seed(0)
    model = build_demo_model(DemoConfig(**GPT_CFG), dtype=torch.float32, device="cuda").train()
    if name != "bf16":
        from torchao.quantization import quantize_

        from qtensor.training import TrainingConfig
        quantize_(model, TrainingConfig(NVFP4TrainingRecipe(**RECIPES[name])),
                  filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fwd = model
    if mode != "eager":
        torch._dynamo.reset()
        fwd = torch.compile(model, fullgraph=True, mode=None if mode == "default" else mode)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def in_calling_thread(step):
    """step with its backward run in the calling thread rather than the engine's device thread
    (torch.autograd.set_multithreading_enabled(False) is thread-local)."""
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return run


def gpt_section(recipes, compiled, warmup, iters):
    """Every eager row first, then the compiled ones: a compiled model's state (dynamo's caches,
    CUDA graph pools) is never around while an eager row is timed. The first recipe's eager
    step is timed once more at the end, to show whether compiling changed eager steps."""
    out = {}
    names = ["bf16", *recipes]
    for name in names:
        step = gpt_step(name)
        out[name] = {"eager_ms": step_ms(step, warmup, iters),
                     "eager_caller_ms": step_ms(in_calling_thread(step), warmup, iters)}
        del step
        torch.cuda.empty_cache()
    for name in [n for n in names if n in compiled]:
        step = gpt_step(name, "default")
        out[name]["compiled_ms"] = step_ms(step, warmup + 2, iters)
        out[name]["compiled_caller_ms"] = step_ms(in_calling_thread(step), warmup, iters)
        out[name]["graphed_ms"] = step_ms(gpt_step(name, "reduce-overhead"), warmup + 2, iters)
        del step
        torch.cuda.empty_cache()
    for name in names:
        print(f"gpt    {name:12s} " + " ".join(f"{k} {v:8.2f}" for k, v in out[name].items()),
              flush=True)
    if recipes:
        again = step_ms(gpt_step(recipes[0]), warmup, iters)
        print(f"gpt    {recipes[0]} eager again after the compiled rows: {again:.2f} ms",
              flush=True)
    return out


def moe_section(recipes, warmup, iters, experts=128, top_k=8, tokens=8192, hidden=2048,
                inter=768):
    from qtensor.training import GroupedLinear

    routed = tokens * top_k
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(experts), routed, replacement=True, generator=g)
    counts = torch.bincount(counts, minlength=experts)
    counts = (counts // 32) * 32  # a quantized backward blocks along each expert's tokens
    counts[0] += routed - int(counts.sum())
    splits = counts.tolist()
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(routed, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(routed, hidden, device="cuda", dtype=torch.bfloat16) * 1e-3
    out = {}
    w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda") * 0.02).bfloat16()
    try:
        holder = torch.nn.ParameterList([w1.clone(), w2.clone()])
        w1b, w2b = holder[0], holder[1]

        def bf16_loss(_):
            h = torch._grouped_mm(x, w1b.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2b.transpose(-2, -1),
                                  offs=offs)
            return (y * dy).sum()
        out["bf16"] = {"eager_ms": step_ms(sgd_step(holder, bf16_loss), warmup, iters)}
    except Exception as e:  # noqa: BLE001 - reported, the quantized rows still run
        out["bf16"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(f"moe    bf16         {out['bf16']}", flush=True)
    for name in recipes:
        recipe = NVFP4TrainingRecipe(**RECIPES[name])
        fc1 = GroupedLinear(experts, hidden, 2 * inter, bias=False, recipe=recipe,
                            device="cuda", dtype=torch.bfloat16)
        fc2 = GroupedLinear(experts, inter, hidden, bias=False, recipe=recipe, device="cuda",
                            dtype=torch.bfloat16)
        with torch.no_grad():
            fc1.weight.copy_(w1)
            fc2.weight.copy_(w2)
        mods = torch.nn.ModuleList([fc1, fc2])

        def loss(_, fc1=fc1, fc2=fc2):
            gate, up = fc1(x, splits).chunk(2, dim=-1)
            return (fc2(torch.nn.functional.silu(gate) * up, splits) * dy).sum()
        try:
            out[name] = {"eager_ms": step_ms(sgd_step(mods, loss), 1, max(3, iters // 3))}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"moe    {name:12s} {out[name]}", flush=True)
        del fc1, fc2, mods
        torch.cuda.empty_cache()
    return out


def qat_section(warmup, iters):
    from qtensor.cli.models import DemoConfig, SwiGLU
    from qtensor.qat import MXFP4QATConfig
    from qtensor.qat import quantize_ as qat_quantize_

    cfg = DemoConfig(vocab_size=256, hidden=4096, layers=1, heads=32, kv_heads=8,
                     intermediate=14336)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x) * 1e-3
    torch.manual_seed(0)
    base = SwiGLU(cfg).to(device="cuda", dtype=torch.bfloat16)

    def loss(model):
        return (model(x) * dy).sum()
    out = {"bf16": {"eager_ms": step_ms(sgd_step(base, loss), warmup, iters)}}
    print(f"qat    bf16         {out['bf16']}", flush=True)
    import copy
    for host in ("mxfp8", "fp8_block128"):
        for native in ((False, True) if host == "fp8_block128" else (False,)):
            m = copy.deepcopy(base)
            qat_quantize_(m, MXFP4QATConfig(host=host, direct=True, native_gemm=native))
            name = f"{host}{' native' if native else ' emulated' if host != 'mxfp8' else ''}"
            out[name] = {"eager_ms": step_ms(sgd_step(m, loss), warmup, iters)}
            print(f"qat    {name:12s} {out[name]}", flush=True)
            del m
            torch.cuda.empty_cache()
    return out


def host_us(step, device, reps, steps) -> float:
    """Median microseconds a call of step() over `reps` loops of `steps` calls (after one loop
    of warm-up); on a GPU each loop is synchronized once, at its ends."""
    import statistics
    import time

    times = []
    for rep in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        if rep:  # the first loop warms up
            times.append(1e6 * (time.perf_counter() - t) / steps)
    return statistics.median(times)


def update_step(mod, fwd, grad):
    """fwd(mod) and its backward from `grad`, then an in-place update of the weight (the next
    forward quantizes it again, as after an optimizer step)."""
    def step():
        fwd(mod).backward(grad)
        with torch.no_grad():
            mod.weight.add_(mod.weight.grad, alpha=-1e-6)
            mod.weight.grad = None
    return step


def host_section(recipes, device, reps=7, steps=200):
    """Median microseconds of a linear's training step (forward, backward, in-place update) at
    64 x 64 x 64, where the host's work is the step's time; on a GPU the loop is synchronized
    once per `steps` steps, so the figure is the host's issue rate while the queue is short.
    Then a GroupedLinear of 8 such experts with 32 tokens each (a quantized backward needs
    token counts of whole 32-blocks), per expert."""
    from qtensor.training import GroupedLinear

    torch.manual_seed(0)
    kw = dict(bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    out = {}
    for name in ["bf16", *recipes]:
        mod = torch.nn.Linear(64, 64, **kw) if name == "bf16" else TrainingLinear(
            64, 64, recipe=NVFP4TrainingRecipe(**RECIPES[name]), **kw)
        step = update_step(mod, lambda m: m(x), g)
        out[name] = {"host_us": host_us(step, device, reps, steps)}
        print(f"host   {name:12s} {out[name]['host_us']:8.1f} us a step", flush=True)
    experts, tokens = 8, 32
    xg = torch.randn(experts * tokens, 64, device=device, dtype=torch.bfloat16,
                     requires_grad=True)
    gg = torch.randn(experts * tokens, 64, device=device, dtype=torch.bfloat16)
    splits = [tokens] * experts
    for name in recipes:
        mod = GroupedLinear(experts, 64, 64, recipe=NVFP4TrainingRecipe(**RECIPES[name]), **kw)
        step = update_step(mod, lambda m: m(xg, splits), gg)
        key = f"grouped {name}"
        out[key] = {"host_us": host_us(step, device, reps, steps // 4) / experts}
        print(f"host   {key:20s} {out[key]['host_us']:8.1f} us a step per expert", flush=True)
    return out


def back_to_back_us(fn, warmup, iters, calls=10) -> float:
    """GPU microseconds per call of `calls` calls issued back to back (the host runs ahead, as
    in a training step), median over `iters` such runs."""
    return 1e3 * cuda_time_ms(lambda: [fn() for _ in range(calls)], warmup, iters) / calls


def gemm_section(warmup, iters):
    from qtensor import MXFP8Tensor, NVFP4Tensor
    from qtensor.gemm import quantized_mm

    out = {}
    for m, n, k in ((8192, 14336, 4096), (8192, 4096, 14336), (4096, 4096, 4096),
                    (8192, 8192, 8192)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        r = {"bf16_us": back_to_back_us(lambda: a @ b.t(), warmup, iters)}
        for fmt, cls in (("nvfp4", NVFP4Tensor), ("mxfp8", MXFP8Tensor)):
            qa, qb = cls.from_hp(a, check_finite=False), cls.from_hp(b, check_finite=False)
            r[f"{fmt}_us"] = back_to_back_us(lambda: quantized_mm(qa, qb.t()), warmup, iters)
        out[f"{m}x{n}x{k}"] = r
        print(f"gemm   {m}x{n}x{k}: " + " ".join(f"{k_} {v:8.1f}" for k_, v in r.items()) +
              f"  nvfp4 {r['bf16_us'] / r['nvfp4_us']:.3f}x mxfp8 {r['bf16_us'] / r['mxfp8_us']:.3f}x",
              flush=True)
        del a, b
    from qtensor.gemm.grouped import grouped_mm

    for experts, tokens, k, n in ((8, 8192, 2048, 1536), (128, 65536, 2048, 1536)):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
        r = {"bf16_us": back_to_back_us(
            lambda: torch._grouped_mm(x, w.transpose(-1, -2), offs=offs), warmup, iters)}
        for fmt, cls in (("nvfp4", NVFP4Tensor), ("mxfp8", MXFP8Tensor)):
            qa = cls.from_hp(x, check_finite=False)
            qw = cls.from_hp(w, check_finite=False).transpose(-1, -2)
            r[f"{fmt}_us"] = back_to_back_us(lambda: grouped_mm(qa, qw, offs), warmup, iters)
        out[f"grouped E={experts} {tokens}x{n}x{k}"] = r
        print(f"gemm   grouped E={experts}: " + " ".join(f"{k_} {v:8.1f}" for k_, v in r.items()),
              flush=True)
        del x, w
    return out


def backward_section(shapes, warmup, iters) -> dict:
    """The RL forward settings' backward table (quantize(dY) + dgrad + wgrad)."""
    results = {"backward": {}, "linear_fwd_bwd": {}}
    print(f"{'shape (tokens, in, out)':42s} {'bf16':>8s} {'mxfp8':>8s} {'nvfp4':>8s} "
          f"{'dgrad_mxfp8':>11s} {'dgmx/bf16':>9s}  backend")
    for name in shapes:
        t, k, n = SHAPES[name]
        x = (torch.randn(t, k, device="cuda") * 0.5).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        dy = (torch.randn(t, n, device="cuda") * 1e-3).to(torch.bfloat16)
        r = backward_times(x, w, dy, warmup, iters)
        results["backward"][name] = r
        b = {c: r[c]["bwd_ms"] for c in r}
        print(f"{name + ' ' + str((t, k, n)):42s} {b['bf16']:8.3f} {b['mxfp8']:8.3f} "
              f"{b['nvfp4']:8.3f} {b['dgrad_mxfp8']:11.3f} {b['dgrad_mxfp8'] / b['bf16']:9.2f}"
              f"  {r['nvfp4']['backend']}", flush=True)
        del x, w, dy
        lt = linear_times(t, k, n, warmup, iters)
        results["linear_fwd_bwd"][name] = lt
        print(f"{'  Linear fwd+bwd (ms)':42s} {lt['bf16']:8.3f} {'':>8s} {lt['nvfp4']:8.3f} "
              f"{lt['dgrad_mxfp8']:11.3f} {lt['dgrad_mxfp8'] / lt['bf16']:9.2f}", flush=True)
        torch.cuda.empty_cache()
    return results


def markdown(results: dict) -> str:
    """The step tables: ms and the ratio to bf16 of the same section and mode."""
    lines = [f"device {results['device']}, torch {results['torch']}", ""]
    for sec in ("layer", "gpt", "moe", "qat"):
        if sec not in results:
            continue
        rows = results[sec]
        base = rows.get("bf16", {})
        modes = [m for m in ("eager_ms", "eager_caller_ms", "compiled_ms", "compiled_caller_ms",
                             "graphed_ms") if any(m in r for r in rows.values())] or ["eager_ms"]
        heads = {"eager_ms": "eager ms", "eager_caller_ms": "eager, backward in caller ms",
                 "compiled_ms": "compiled ms",
                 "compiled_caller_ms": "compiled, backward in caller ms",
                 "graphed_ms": "compiled + CUDA graphs ms"}
        lines += [f"### {sec}", "", "| config | " + " | ".join(
            f"{heads[m]} | vs bf16" for m in modes) + " |", "|---" * (1 + 2 * len(modes)) + "|"]
        for name, r in rows.items():
            cells = []
            for mode in modes:
                v, b = r.get(mode), base.get(mode)
                cells += [f"{v:.2f}" if v else "", f"{v / b:.2f}x" if v and b else ""]
            if "error" in r:
                cells = [r["error"][:80]] + [""] * (2 * len(modes) - 1)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if "host" in results:
        rows = results["host"]
        base = rows.get("bf16", {}).get("host_us")
        lines += ["### host", "", "| config (grouped: per expert) | us a linear step | vs bf16 |",
                  "|---|---|---|"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['host_us']:.1f} | "
                         f"{r['host_us'] / base:.2f}x |" if base else f"| {name} | {r['host_us']:.1f} | |")
        lines.append("")
    if "gemm" in results:
        lines += ["### gemm", "", "| M x N x K | bf16 us | NVFP4 us | vs bf16 | MXFP8 us | vs bf16 |",
                  "|---|---|---|---|---|---|"]
        for shape, r in results["gemm"].items():
            lines.append(f"| {shape} | {r['bf16_us']:.0f} | {r['nvfp4_us']:.0f} | "
                         f"{r['bf16_us'] / r['nvfp4_us']:.3f}x | {r['mxfp8_us']:.0f} | "
                         f"{r['bf16_us'] / r['mxfp8_us']:.3f}x |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sections", default="layer,gpt,moe,qat,gemm")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names")
    ap.add_argument("--compiled", default="nvfp4,dgrad_mxfp8,4over6",
                    help="recipes also timed compiled (bf16 always is, with any)")
    ap.add_argument("--moe-recipes", default="nvfp4,row_scaled")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="backward section: names")
    ap.add_argument("--device", default="cuda", help="host section: cuda or cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--md", default=None, help="write the step tables as markdown here")
    args = ap.parse_args()
    torch.manual_seed(0)
    gpu = args.device == "cuda"
    results = {"device": torch.cuda.get_device_name() if gpu else "CPU",
               "torch": torch.__version__}
    print(f"device {results['device']}, torch {results['torch']}", flush=True)
    recipes = [r for r in args.recipes.split(",") if r]
    compiled = [r for r in args.compiled.split(",") if r]
    compiled = ["bf16", *compiled] if compiled else []
    for sec in args.sections.split(","):
        if sec == "layer":
            results[sec] = layer_section(recipes, compiled, args.warmup, args.iters)
        elif sec == "gpt":
            results[sec] = gpt_section(recipes, compiled, args.warmup, args.iters)
        elif sec == "moe":
            results[sec] = moe_section(args.moe_recipes.split(","), args.warmup, args.iters)
        elif sec == "qat":
            results[sec] = qat_section(args.warmup, args.iters)
        elif sec == "gemm":
            results[sec] = gemm_section(args.warmup, args.iters)
        elif sec == "host":
            results[sec] = host_section(recipes, args.device)
        elif sec == "backward":
            results.update(backward_section(args.shapes.split(","), args.warmup, args.iters))
        else:
            raise SystemExit(f"unknown section {sec!r}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        if args.md:
            with open(args.md, "w") as f:
                f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
