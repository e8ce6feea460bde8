"""How much the RHT + SR cast and the amax after RHT depend on the spread of the input's runs.

    python dev/experiments/rht_sr_input_ranges.py          # on the GPU machine

The CUDA kernels sum a 16-run down a column in fp32 when its nonzero magnitudes lie within
2**12 of each other (Bf16Range::f32_exact in csrc/cuda_vec.cuh: fmax <= fmin + 12, fmin >= 10,
fmax <= 249 on the bf16 exponent fields). Another run keeps its fp32 results where their error
bound pins the bf16 rounding (rht_rounding_pinned in csrc/quant_math.h); the rest go through the
reference's fp64 butterfly over a half-warp, and the warp's CTA waits for it at the staging
barrier. This times both kernels at 16384x8192 bf16, beside a copy of the same input, on inputs
whose runs spread differently, and prints for each the share of runs outside the fp32 test, the
share left to fp64 (computed here from an fp32 butterfly in torch), and the share of warp tiles
(16 rows x 64 columns: 64 runs) holding at least one of those:
- `narrow`: magnitudes in [1, 2) (no run outside the test);
- `gaussian`: torch.randn;
- `gaussian, half zeros`: randn with half the elements zero (zeros do not count in the test);
- `log-normal`: randn * 2**(3 randn), a spread like that of some gradients;
- training gradients: the output gradients and inputs of a few decoder linears of the study's
  model (qtensor/cli/study_train.py; width 512, 4 layers) after 60 bf16 steps on the Python
  standard library, tiled to the same shape (the spread of each run is unchanged). The gradients
  of the attention projections spread widely down the tokens.

    python dev/experiments/rht_sr_input_ranges.py [--no-training]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_quantize import time_cuda  # noqa: E402

from qtensor.formats.nvfp4 import NVFP4Spec, SRSeed, sr_state_tensor  # noqa: E402
from qtensor.formats.rht import RHT_SIGNS  # noqa: E402
from qtensor.ops import quant as Q  # noqa: E402

SHAPE = (16384, 8192)


def outside_and_left(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M / 16, K] bool each: the 16-runs down the columns that the kernels' fp32 range test
    refuses, and those of them whose fp32 butterfly results the error bound does not pin."""
    a = (x.view(torch.int16).to(torch.int32) & 0x7FFF).view(-1, 16, x.shape[1])
    fmax = a.amax(dim=1) >> 7
    lo = torch.where(a == 0, torch.full_like(a, 0x10000), a - 1).amin(dim=1)
    fmin = torch.where(lo == 0x10000, torch.full_like(lo, 255), lo >> 7)
    outside = ~((fmax <= 249) & (fmin >= 10) & (fmax <= fmin + 12))
    # the fp32 butterfly (signed_hadamard16<float>), each stage in the kernels' order
    s = x.float().view(-1, 16, x.shape[1]) * torch.tensor(RHT_SIGNS, dtype=torch.float32,
                                                          device=x.device)[:, None]
    h = 1
    while h < 16:
        s = s.view(s.shape[0], 16 // (2 * h), 2, h, -1)
        s = torch.stack((s[:, :, 0] + s[:, :, 1], s[:, :, 0] - s[:, :, 1]), 2).reshape(-1, 16, x.shape[1])
        h *= 2
    bound = torch.exp2(fmax.double() - 146).float()[:, None]
    ends = [(s + sign * bound).bfloat16().view(torch.int16) for sign in (-1, 1)]
    pinned = (ends[0] == ends[1]).all(dim=1) & (fmax >= 24) & (fmax <= 249)
    return outside, outside & ~pinned


def inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    def randn():
        return torch.randn(SHAPE, generator=g, device="cuda")

    half = randn()
    half[torch.rand(SHAPE, generator=g, device="cuda") < 0.5] = 0
    return {
        "narrow": torch.sign(randn()) * (1 + torch.rand(SHAPE, generator=g, device="cuda")),
        "gaussian": randn(),
        "gaussian, half zeros": half,
        "log-normal": randn() * torch.exp2(3 * randn()),
    }


def training_gradients(steps: int = 60) -> dict[str, torch.Tensor]:
    """Output gradients and inputs of a few decoder linears after `steps` bf16 training steps of
    the study's model, each [tokens, features] bf16, tiled to SHAPE."""
    from qtensor.cli import study_train as st

    preset = st.Preset(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408, batch=16,
                       seq=512, steps=steps, lr=1e-3, eval_every=steps, eval_batches=1,
                       grad_steps=(), max_bytes=64 << 20)
    train, _ = st.load_splits(st.stdlib_files(), preset.max_bytes, preset.batch * (preset.seq + 1))
    model = st.build_demo_model(preset.model_config(), seed=0, dtype=torch.float32,
                                device=torch.device("cuda")).train()
    keep = ("blocks.1.attn.q_proj", "blocks.1.attn.v_proj", "blocks.1.mlp.down_proj")
    captured: dict[str, torch.Tensor] = {}
    last = False

    def hook(name):
        def fwd(module, args, out):
            if last:
                captured[f"{name} input"] = args[0].detach().reshape(-1, args[0].shape[-1]).bfloat16()
                out.register_hook(lambda g: captured.__setitem__(
                    f"{name} output gradient", g.detach().reshape(-1, g.shape[-1]).bfloat16()))
        return fwd

    for name, m in st.decoder_linears(model).items():
        if name in keep:
            m.register_forward_hook(hook(name))
    opt = torch.optim.AdamW(model.parameters(), lr=preset.lr)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        last = step == steps - 1
        x, y = (t.cuda() for t in st.batch_at(train, g, preset.batch, preset.seq))
        loss = st._loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    out = {}
    for name, t in sorted(captured.items()):
        reps = (math.ceil(SHAPE[0] / t.shape[0]), math.ceil(SHAPE[1] / t.shape[1]))
        out[f"training: {name}"] = t.repeat(*reps)[: SHAPE[0], : SHAPE[1]].contiguous()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-training", action="store_true", help="skip the training gradients")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    spec = NVFP4Spec(columnwise=True, rht=True, stochastic_rounding=True)
    sr = sr_state_tensor(SRSeed(1, 0), "cuda")
    cases = inputs(g)
    if not args.no_training:
        cases.update(training_gradients())
    print(f"# {torch.cuda.get_device_name()}, {SHAPE[0]}x{SHAPE[1]} bf16; us, and the ratio to a copy")
    print("| input | runs outside fp32 | left to fp64 | warp tiles with one left | copy us | RHT + SR us "
          "| of copy | amax after RHT us |")
    print("|---|---|---|---|---|---|---|---|")
    for name, x in cases.items():
        x = x.bfloat16()
        outside, left = outside_and_left(x)
        # a warp of the tile kernel holds one 16-row panel (one row of runs) x 64 columns
        warp_tiles = left.view(left.shape[0], left.shape[1] // 64, 64).any(dim=2)
        amax = Q.amax(x, columnwise=True, rht=True)
        copy = time_cuda(lambda t: t.clone(), [x])
        cast = time_cuda(lambda t: Q.nvfp4_codes(t, amax, spec, sr), [x])
        amax_t = time_cuda(lambda t: Q.amax(t, columnwise=True, rht=True), [x])
        ratio = (2 + 0.5625) * copy / (4 * cast)  # bytes per second over the copy's
        print(f"| {name} | {outside.float().mean().item():.4f} | {left.float().mean().item():.4f} "
              f"| {warp_tiles.float().mean().item():.3f} | {copy * 1e6:.1f} | {cast * 1e6:.1f} "
              f"| {ratio:.2f} | {amax_t * 1e6:.1f} |")


if __name__ == "__main__":
    main()
