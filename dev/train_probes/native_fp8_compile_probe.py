"""Why a compiled MXFP4 QAT step on the FP8 block host with native GEMMs (`native_gemm=True`)
was not bitwise equal to the eager step (tests/test_compile_gpu.py's
test_training_step_inductor_cuda[qat_fp8_block128] with the native GEMM on, 2026-12-07).

Prints, for the test's model (Linear(128, 128) + GELU + Linear(128, 128), bf16, x [128, 128]):
1. whether two eager steps are bitwise equal (cuBLAS run to run);
2. whether the native op gives the same bits when its operands sit at other 16-byte-aligned
   offsets (cuBLAS picks algorithms by pointer alignment);
3. which of the compiled step's output, input gradient and parameter gradients differ from
   eager, and by how much; and the same with native_gemm=False (the default, emulated).

    python dev/train_probes/native_fp8_compile_probe.py
"""
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_compile_training import step  # noqa: E402

from qtensor.formats import fp8_block as ref  # noqa: E402
from qtensor.ops.fp8_block import fp8_block_scaled_mm  # noqa: E402
from qtensor.qat import MXFP4QATConfig, quantize_  # noqa: E402


def model(native: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128, bias=False))
    m = m.to(torch.bfloat16).cuda()
    return quantize_(m, MXFP4QATConfig(host="fp8_block128", native_gemm=native))


def diffs(a, b) -> list[str]:
    names = ["output", "input gradient"] + [f"grad {i}" for i in range(len(a[2]))]
    out = []
    for name, x, y in zip(names, [a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        if not torch.equal(x, y):
            d = (x.float() - y.float()).abs()
            out.append(f"{name}: {int((d > 0).sum())} of {d.numel()} differ, max {d.max():.3e}")
    return out or ["bitwise equal"]


def offset_copy(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """t's values in a fresh buffer starting offset_bytes past a 256-byte boundary."""
    flat = torch.empty(t.numel() * t.element_size() + 512, dtype=torch.uint8, device=t.device)
    view = flat[offset_bytes:offset_bytes + t.numel() * t.element_size()].view(t.dtype)
    view = view.view(t.shape)
    view.copy_(t)
    return view


def main():
    x = torch.randn(128, 128, dtype=torch.bfloat16, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(1))
    for native in (True, False):
        m = model(native)
        e1, e2 = step(m, m, x), step(m, m, x)
        print(f"native={native} eager vs eager: {diffs(e1, e2)}")
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=True)
        with inductor_config.patch(emulate_precision_casts=True):
            c = step(m, compiled, x)
        print(f"native={native} compiled vs eager: {diffs(c, e1)}")
    g = torch.Generator("cuda").manual_seed(2)
    a_hp = torch.randn(512, 1024, device="cuda", generator=g)
    b_hp = torch.randn(768, 1024, device="cuda", generator=g) * 0.05
    a, a_s = ref.quantize(a_hp, ref.FP8BlockSpec("1x128"))
    b, b_s = ref.quantize(b_hp, ref.FP8BlockSpec("128x128"))
    base = fp8_block_scaled_mm(a, a_s, b, b_s, True, None, torch.float32)
    for off in (16, 32, 64, 128, 256):
        got = fp8_block_scaled_mm(offset_copy(a, off), a_s, offset_copy(b, off), b_s, True, None,
                                  torch.float32)
        print(f"native op, operands at +{off} B: "
              f"{'bitwise equal' if torch.equal(got, base) else 'differs, max %.3e' % (got - base).abs().max()}")


if __name__ == "__main__":
    main()
