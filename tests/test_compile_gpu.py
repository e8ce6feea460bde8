"""torch.compile on the GPU: every inference config, every training recipe's forward + backward
and both QAT hosts, under Inductor's modes "default", "max-autotune-no-cudagraphs" and
"reduce-overhead" (CUDA graphs); fullgraph, no graph break, no recompilation when the batch or
sequence length changes, and outputs bitwise equal to eager. Run by benchmarks/gpu_check.sh.

Eager and compiled run the same kernels: the GEMMs are the opaque qtensor ops (their CUDA
kernels launch the Triton GEMMs), the quantizers the opaque csrc ops. Bitwise equality also
needs `emulate_precision_casts`: without it Inductor keeps a fused bf16 intermediate (one
layer's output cast, read by the next elementwise op) in fp32, which eager does not.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from qtensor.cli.models import DemoConfig, build_demo_model, demo_tokens
from test_compile_inference import BASE_CONFIGS, CONFIG_NAMES, quantized, small_mlp
from test_compile_training import QAT, RECIPES, assert_bitwise, sr_model, step, training_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CFG = DemoConfig(vocab_size=512, hidden=256, layers=2, heads=4, kv_heads=2, intermediate=704)
MODES = ["default", "max-autotune-no-cudagraphs", "reduce-overhead"]


def assert_same(out, ref, what):
    diff = (out.float() - ref.float()).abs().max().item()
    assert torch.equal(out, ref), f"{what}: max |diff| {diff}"


def compile_counting(model, mode: str):
    """torch.compile(model, mode=mode, fullgraph=True), with counters reset: afterwards
    counters["stats"]["unique_graphs"] is the number of compiled graphs."""
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, mode=mode, fullgraph=True)


def assert_one_graph():
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs compiled (a recompilation)"


def _gemm_ops_in(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if "qtensor." in str(n.target)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_inference_configs_compile_on_cuda(name, mode):
    """Every quantize_ config on a 3-D-fed MLP: two (batch, seq) shapes, one graph, bitwise."""
    model = quantized(small_mlp().cuda(), name)
    compiled = compile_counting(model, mode)
    gen = torch.Generator("cuda").manual_seed(1)
    with inductor_config.patch(emulate_precision_casts=True), torch.no_grad():
        for b, t in ((2, 5), (3, 7), (2, 5)):
            x = torch.randn(b, t, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            out = compiled(x).clone()
            assert_same(out, model(x), f"{name} {mode} {b}x{t}")
    assert_one_graph()


def relative_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("name", BASE_CONFIGS)
def test_demo_transformer_inductor_cuda(name):
    """The demo transformer compiles in one frame for two shapes. Its attention, norms and
    rotary embedding are bf16 code that Inductor fuses and rounds differently from eager, so
    the unquantized model's logits differ too: the quantized model's may differ by a multiple
    of that, since a quantized activation turns a one-ulp bf16 difference into at most one
    code step (16 bf16 ulps for E4M3). The bitwise claim for the quantized layers is the MLP
    test's."""
    model = quantized(build_demo_model(CFG, device="cuda"), name)
    plain = build_demo_model(CFG, device="cuda")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    compiled_plain = torch.compile(plain, backend="inductor", fullgraph=True)
    with inductor_config.patch(emulate_precision_casts=True), torch.no_grad():
        for b, t in ((2, 64), (4, 96)):
            tokens = demo_tokens(CFG, b, t, device="cuda")
            torch._dynamo.mark_dynamic(tokens, 0)
            torch._dynamo.mark_dynamic(tokens, 1)
            err = relative_error(compiled(tokens), model(tokens))
            plain_err = relative_error(compiled_plain(tokens), plain(tokens))
            assert err < max(64 * plain_err, 4e-3), (
                f"{name} {b}x{t}: {err:.2e} (bf16 model: {plain_err:.2e})")
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", ["nvfp4_weight_only", "mxfp8_weight_only", "nvfp4_dynamic",
                                  "mxfp8_dynamic"])
def test_decode_reduce_overhead(name):
    """One-token decode steps replayed through a CUDA graph equal eager, step after step."""
    model = quantized(build_demo_model(CFG, device="cuda"), name)
    step_fn = compile_counting(model, "reduce-overhead")
    with inductor_config.patch(emulate_precision_casts=True), torch.no_grad():
        for i in range(4):  # warm-up, capture, then replays
            tokens = demo_tokens(CFG, 8, 1, seed=i, device="cuda")
            out = step_fn(tokens).clone()
            assert_same(out, model(tokens), f"{name} step {i}")
    assert_one_graph()


def cuda_training_model(name):
    return training_model(name).cuda()


def compiled_training_step_matches_eager(model, mode: str, x):
    ref = step(model, model, x)
    compiled = compile_counting(model, mode)
    with inductor_config.patch(emulate_precision_casts=True):
        for _ in range(2):  # the second step replays (CUDA graphs) or reuses the graph
            out = step(model, compiled, x)
            assert_bitwise(out[0], ref[0], "output")
            assert_bitwise(out[1], ref[1], "input gradient")
            for (pname, _), g, r in zip(model.named_parameters(), out[2], ref[2]):
                assert_bitwise(g, r, f"gradient of {pname}")
    assert_one_graph()


@pytest.mark.parametrize("name", list(RECIPES) + list(QAT))
def test_training_step_inductor_cuda(name):
    x = torch.randn(128, 128, dtype=torch.bfloat16, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(1))
    compiled_training_step_matches_eager(cuda_training_model(name), "default", x)


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
@pytest.mark.parametrize("name", ["dgrad_mxfp8", "nvfp4_backward", "qat_mxfp8"])
def test_training_step_modes_cuda(name, mode):
    x = torch.randn(128, 128, dtype=torch.bfloat16, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(2))
    compiled_training_step_matches_eager(cuda_training_model(name), mode, x)


@pytest.mark.parametrize("kw", [{}, dict(dgrad_mxfp8=True)], ids=["default", "dgrad_mxfp8"])
def test_default_recipe_steps_compile_on_cuda(kw):
    """The default recipe (2D weights, RHT, stochastic rounding): three compiled steps, each
    rounding with the state buffer's next bits, equal eager's step by step."""
    eager, compiled_model = sr_model(**kw).cuda(), sr_model(**kw).cuda()
    gen = torch.Generator("cuda").manual_seed(3)
    xs = [torch.randn(128, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
          for _ in range(3)]
    compiled = compile_counting(compiled_model, "default")
    with inductor_config.patch(emulate_precision_casts=True):
        for i, x in enumerate(xs):
            ref, out = step(eager, eager, x), step(compiled_model, compiled, x)
            assert_bitwise(out[1], ref[1], f"step {i} input gradient")
            for (pname, _), g, r in zip(eager.named_parameters(), out[2], ref[2]):
                assert_bitwise(g, r, f"step {i} gradient of {pname}")
    assert_one_graph()


@pytest.mark.parametrize("layout", ["auto", "canonical"])
def test_compiled_graph_holds_the_gemm_op_on_cuda(layout):
    """The aten graph of a CUDA weight-only linear calls one registered GEMM op: the decode GEMM
    where the layout `auto` packed the weight (a GPU with the decode kernel), else
    qtensor.nvfp4_mm, as on the CPU."""
    from qtensor import NVFP4WeightOnlyConfig, quantize_
    from qtensor.ops.decode_mm import device_kernel_problem
    from test_compile_inference import forward_graph

    torch.manual_seed(0)
    model = quantize_(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(
        torch.bfloat16).cuda(), NVFP4WeightOnlyConfig(layout=layout))
    gm = forward_graph(model, torch.randn(8, 64, dtype=torch.bfloat16, device="cuda"))
    packed = layout == "auto" and device_kernel_problem(torch.device("cuda"), "nvfp4") is None
    assert _gemm_ops_in(gm) == {"qtensor.decode_mm.default" if packed else "qtensor.nvfp4_mm.default"}
