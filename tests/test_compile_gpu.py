"""torch.compile on the GPU: the demo transformer under Inductor (every config class), and
decoding with mode="reduce-overhead" (CUDA graphs). Run by benchmarks/gpu_check.sh.

The tolerance: with the triton GEMM backend (the default on Hopper) eager and compiled run the
same kernels, but Inductor may fuse the epilogue of one layer into the next one's prologue and
skip a bf16 rounding unless emulate_precision_casts is set (it is here), so the assertion is
bitwise; a failure prints the largest difference.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._dynamo.testing import CompileCounterWithBackend

from qtensor.models import DemoConfig, build_demo_model, demo_tokens
from test_compile_inference import BASE_CONFIGS, quantized

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CFG = DemoConfig(vocab_size=512, hidden=256, layers=2, heads=4, kv_heads=2, intermediate=704)


def assert_same(out, ref, what):
    diff = (out.float() - ref.float()).abs().max().item()
    assert torch.equal(out, ref), f"{what}: max |diff| {diff}"


@pytest.mark.parametrize("name", BASE_CONFIGS)
def test_demo_transformer_inductor_cuda(name):
    model = quantized(build_demo_model(CFG, device="cuda"), name)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with inductor_config.patch(emulate_precision_casts=True), torch.no_grad():
        for b, t in ((2, 64), (4, 96)):
            tokens = demo_tokens(CFG, b, t, device="cuda")
            torch._dynamo.mark_dynamic(tokens, 0)
            torch._dynamo.mark_dynamic(tokens, 1)
            assert_same(compiled(tokens), model(tokens), f"{name} {b}x{t}")
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", ["nvfp4_dynamic", "mxfp8_dynamic"])
def test_decode_reduce_overhead(name):
    """One-token decode steps replayed through a CUDA graph equal eager, step after step."""
    model = quantized(build_demo_model(CFG, device="cuda"), name)
    torch._dynamo.reset()
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with inductor_config.patch(emulate_precision_casts=True), torch.no_grad():
        for i in range(4):  # warm-up, capture, then replays
            tokens = demo_tokens(CFG, 8, 1, seed=i, device="cuda")
            out = step(tokens).clone()
            assert_same(out, model(tokens), f"{name} step {i}")
