"""torch.compile of quantized inference: fullgraph, dynamic batch/sequence, bitwise equal to eager.

Every quantize_ config runs on a small MLP fed 3-D activations [B, T, H] under Inductor (CPU) and
the four config classes on the demo transformer under aot_eager (the full Dynamo + AOTAutograd
trace of the subclasses without Inductor's C++ build, which takes a minute per config on two
cores; the GPU check compiles the demo model with Inductor). Bitwise equality needs
`emulate_precision_casts`: without it Inductor keeps a fused bf16 intermediate in fp32 (the
cast of one layer's output before the next layer reads it), which is not what eager computes.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from qtensor import MXFP8Spec, NVFP4Spec
from qtensor.cli.models import DemoConfig, build_demo_model, demo_tokens

torch.set_num_threads(1)  # the runner's 2 cores are shared; Inductor's C++ build uses them


def configs():
    import qtensor as q

    return {
        "nvfp4_weight_only": q.NVFP4WeightOnlyConfig(),
        "nvfp4_weight_only_2d": q.NVFP4WeightOnlyConfig(NVFP4Spec(block_2d=True)),
        "nvfp4_dynamic": q.NVFP4DynamicActivationNVFP4WeightConfig(),
        "nvfp4_dynamic_rowscaled_4over6": q.NVFP4DynamicActivationNVFP4WeightConfig(
            weight=NVFP4Spec(fourover6="mse", e4m3_bound=256),
            activation=NVFP4Spec(row_scaled=True, fourover6="mae", e4m3_bound=256),
        ),
        "mxfp8_weight_only": q.MXFP8WeightOnlyConfig(MXFP8Spec("floor")),
        "mxfp8_dynamic": q.MXFP8DynamicActivationMXFP8WeightConfig(),
    }


CONFIG_NAMES = list(configs())
BASE_CONFIGS = ["nvfp4_weight_only", "nvfp4_dynamic", "mxfp8_weight_only", "mxfp8_dynamic"]
TINY = DemoConfig(vocab_size=64, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=96)


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64, bias=False)
    ).to(torch.bfloat16).eval()


def quantized(model: nn.Module, name: str) -> nn.Module:
    from qtensor import quantize_

    return quantize_(model, configs()[name])


def compile_and_compare(model, inputs, backend: str, dynamic_dims):
    """Compile once, run every input; assert bitwise equality and a single compiled frame."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with inductor_config.patch(emulate_precision_casts=True), torch.no_grad():
        for x in inputs:
            for d in dynamic_dims:
                torch._dynamo.mark_dynamic(x, d)
            out, ref = compiled(x), model(x)
            assert out.dtype == ref.dtype and out.shape == ref.shape
            assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), (
                f"compiled != eager for input {tuple(x.shape)}: max |diff| "
                f"{(out.float() - ref.float()).abs().max().item()}"
            )
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_mlp_3d_inductor(name):
    model = quantized(small_mlp(), name)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(b, t, 64, generator=gen, dtype=torch.bfloat16) for b, t in
              ((2, 5), (3, 7))]
    compile_and_compare(model, inputs, "inductor", dynamic_dims=(0, 1))


@pytest.mark.parametrize("name", BASE_CONFIGS)
def test_demo_transformer_aot(name):
    model = quantized(build_demo_model(TINY), name)
    inputs = [demo_tokens(TINY, 2, 16), demo_tokens(TINY, 3, 24, seed=1)]
    compile_and_compare(model, inputs, "aot_eager", dynamic_dims=(0, 1))


# ---- what the compiled graph computes ---------------------------------------------------------


def forward_graph(model, x) -> torch.fx.GraphModule:
    """The aten-level inference graph AOTAutograd hands to the backend."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(x)
    assert len(graphs) == 1
    return graphs[0]


def op_names(gm: torch.fx.GraphModule) -> str:
    names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    return "\n".join(sorted(names))


def depends_on(gm: torch.fx.GraphModule, source: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes computed from `source`, in graph order."""
    reached = {source}
    for n in gm.graph.nodes:
        if any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return [n for n in gm.graph.nodes if n in reached and n is not source]


def test_weight_only_graph_never_dequantizes_the_weight():
    """The graph is one opaque qtensor GEMM op fed the weight's bytes as they are stored: no op
    touches the weight's codes, scales or amax before the GEMM."""
    torch.manual_seed(0)
    model = quantized(nn.Sequential(nn.Linear(64, 32, bias=False)).to(torch.bfloat16),
                      "nvfp4_weight_only")
    gm = forward_graph(model, torch.randn(8, 64, dtype=torch.bfloat16))
    assert_expected_inline(op_names(gm), """qtensor.nvfp4_mm.default""")
    (mm,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    placeholders = {tuple(n.meta["val"].shape): n for n in gm.graph.nodes if n.op == "placeholder"}
    # a, a_scale, a_amax, then the weight's codes [32, 32], scales [32, 4] and scalar amax.
    assert mm.args[3:6] == (placeholders[(32, 32)], placeholders[(32, 4)], placeholders[()])
    assert mm.args[0] is placeholders[(8, 64)] and mm.args[1:3] == (None, None)


def test_unsupported_op_names_itself_under_compile():
    """An op a quantized weight lacks raises naming the op, compiled or not; nothing decodes."""
    from qtensor import NVFP4Tensor

    w = NVFP4Tensor.from_hp(torch.randn(32, 64))

    def f(w):
        return torch.cat([w, w])

    with pytest.raises(NotImplementedError, match="aten.cat"):
        f(w)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="aten.cat"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(w)


def test_dynamic_graph_calls_qtensor_ops_and_no_dequantize():
    """The activation is quantized by the opaque qtensor ops (traced through their fake
    implementations) and both operands' bytes enter the opaque GEMM op: nothing dequantizes."""
    from qtensor.backends import QuantBackend
    from qtensor.ops.quant import extension_status, quant_backend

    if quant_backend("cpu") is not QuantBackend.CPU:
        pytest.skip(f"the CPU kernels are not in use: {extension_status()}")
    def ops_of(name):
        torch.manual_seed(0)
        model = quantized(nn.Sequential(nn.Linear(64, 32, bias=False)).to(torch.bfloat16), name)
        return op_names(forward_graph(model, torch.randn(8, 64, dtype=torch.bfloat16)))

    assert_expected_inline(ops_of("nvfp4_dynamic"), """\
<built-in function getitem>
qtensor.amax.default
qtensor.nvfp4_mm.default
qtensor.nvfp4_quantize.default""")
    assert_expected_inline(ops_of("mxfp8_dynamic"), """\
<built-in function getitem>
qtensor.mxfp8_mm.default
qtensor.mxfp8_quantize.default""")


def test_quantized_tensors_have_a_stable_cache_hash():
    """_stable_hash_for_caching keys torch.compile's AOT autograd cache: equal for tensors of
    the same layout and metadata (in another process too), different when either differs, and
    independent of the bytes."""
    import subprocess
    import sys

    from qtensor import HybridTensor, MXFP8Spec, NVFP4Spec, NVFP4Tensor

    code = ("import torch; from qtensor import NVFP4Tensor; "
            "print(NVFP4Tensor.from_hp(torch.ones(32, 64), row_scaled=True)"
            "._stable_hash_for_caching())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip().splitlines()[-1]
    a = NVFP4Tensor.from_hp(torch.randn(32, 64), row_scaled=True)
    assert a._stable_hash_for_caching() == other
    assert NVFP4Tensor.from_hp(torch.randn(32, 64))._stable_hash_for_caching() != other
    assert NVFP4Tensor.from_hp(torch.randn(32, 128), row_scaled=True)._stable_hash_for_caching() \
        != other
    h = HybridTensor.from_hp(torch.randn(32, 64), rowwise=MXFP8Spec(), columnwise=NVFP4Spec())
    assert len(h._stable_hash_for_caching()) == 32


def test_compile_time_constant_marks_as_torch_does():
    """qtensor.backends.compile_time_constant sets what torch.compiler.assume_constant_result
    sets (without importing Dynamo at qtensor's import)."""
    from qtensor.backends import compile_time_constant

    def probe():
        return "x"

    marked = torch.compiler.assume_constant_result(lambda: "x")
    attrs = {k: v for k, v in vars(marked).items()}
    assert attrs and vars(compile_time_constant(probe)) == attrs
