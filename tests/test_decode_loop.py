"""The greedy decoding loop of benchmarks/bench_decode.py (one-token steps on a static KV cache,
without generate()), on the CPU: its tokens are generate()'s greedy tokens, eager and compiled
with Inductor's freezing, for bf16 and for weights in the decode layout; frozen, it runs one
graph whose constants are the weights' packed bytes. The GPU run times it; this checks that
what it times is greedy decoding, with the weights it claims."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decode  # noqa: E402

import qtensor  # noqa: E402

torch.set_num_threads(1)  # the runner's 2 cores are shared; Inductor's C++ build uses them
PROMPT, WARMUP, STEPS, REPEATS = 6, 1, 2, 2
VOCAB = 96  # the embedding and lm_head [96, 64] differ in size from every quantized weight


def tiny_llama(quantized: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    # fp32: the loop and generate() reach attention through different masks, whose roundings
    # could part two bf16 logits that nearly tie.
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # generate() must not stop or ban end tokens
    if quantized:
        qtensor.quantize_(model, qtensor.NVFP4WeightOnlyConfig(layout="decode"),
                          filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head")
        assert isinstance(model.model.layers[0].mlp.up_proj.weight, qtensor.DecodeWeight)
    return model


def generate_tokens(model, ids, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                             cache_implementation="static", pad_token_id=0, disable_compile=True)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nvfp4_decode_layout"])
def test_eager_loop_is_generate(quantized, prompt):
    model = tiny_llama(quantized)
    seconds, tokens = bench_decode.greedy_loop(model, prompt, STEPS, "eager", warmup=WARMUP,
                                               repeats=REPEATS)
    new = 1 + WARMUP + REPEATS * STEPS  # the prefill's token, then one a step
    assert tokens.shape == (2, new) and seconds > 0
    assert torch.equal(tokens, generate_tokens(model, prompt, new))


FROZEN = re.compile(r"_frozen_param\d+ = rand_strided\(\(([\d, ]*)\),.*dtype=torch\.(\w+)\)")


def test_frozen_loop_is_eager():
    """Compiled with freezing, the loop decodes the eager loop's tokens; every step runs the one
    graph compiled at the first (a step that compiled again, a position as a Python int say,
    would cost seconds); and the graph's constants hold the weights' packed bytes, no weight
    dequantized: freezing folds what depends on constants alone, and the decode op is opaque."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama(quantized=True)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    _, eager = bench_decode.greedy_loop(model, prompt, STEPS, "eager", warmup=WARMUP,
                                        repeats=REPEATS)
    counters.clear()
    (_, frozen), code = run_and_get_code(
        bench_decode.greedy_loop, model, prompt, STEPS, "frozen", warmup=WARMUP,
        repeats=REPEATS)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert torch.equal(frozen, eager)
    assert graphs == 1
    constants = [(math.prod(int(d) for d in shape.split(",") if d.strip()), dtype)
                 for shape, dtype in FROZEN.findall("\n".join(code))]
    packed = [m.weight for m in model.modules()
              if isinstance(getattr(m, "weight", None), qtensor.DecodeWeight)]
    assert len(packed) == 14
    assert sum(dtype == "uint8" for _, dtype in constants) == 2 * len(packed)  # codes, scales
    sizes = {w.numel() for w in packed}  # N x K: what a dequantized weight would hold
    assert not [c for c in constants if c[0] in sizes and c[1] != "uint8"]


def test_loop_mode_is_checked(prompt):
    with pytest.raises(ValueError, match="mode is one of"):
        bench_decode.greedy_loop(None, prompt, 1, "graphed")


def test_loop_table_modes():
    """--modes: eager always (the tokens' reference) and first, the rest in the table's order;
    an unknown mode stops the run before any model is built."""
    assert bench_decode.loop_modes("fused,compiled") == ("eager", "compiled", "fused")
    assert bench_decode.loop_modes("") == ("eager",)
    assert bench_decode.loop_modes(",".join(bench_decode.LOOP_MODES)) == bench_decode.LOOP_MODES
    with pytest.raises(SystemExit, match="--modes takes eager, compiled, frozen, fused; got fast"):
        bench_decode.loop_modes("frozen,fast")


def test_generate_frozen_with_one_cache(prompt):
    """generate() over a forward compiled with freezing decodes its eager tokens call after call
    when it is given one StaticCache, reset between calls: what bench_decode.py's frozen column
    does. (With a new cache each call, the frozen graph, which keeps the first cache, fails at
    the second.)"""
    import torch._inductor.config as inductor_config
    from transformers import StaticCache

    model = tiny_llama(quantized=True)
    new = 4
    eager = generate_tokens(model, prompt, new)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + new + 1)
    kw = {bench_decode.cache_kwarg(model): cache}
    forward = model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(forward, fullgraph=True)
    try:
        with inductor_config.patch(freezing=True), torch.no_grad():
            for _ in range(2):
                cache.reset()
                out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                     disable_compile=True, **kw)
                assert torch.equal(out[:, PROMPT:], eager)
    finally:
        model.forward = forward
        torch._dynamo.reset()
