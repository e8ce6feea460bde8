"""Where a GroupedLinear MoE step's time goes: the bench's experts (128 experts, 512 tokens
each, 2048 -> 1536 gate+up, SwiGLU, 1536/2 -> 2048), forward, backward and an SGD update; the
step's time, then the torch profiler's kernels and host calls over three steps.

    python dev/train_probes/moe_profile.py row      # the row-scaled recipe
    python dev/train_probes/moe_profile.py nvfp4    # the default recipe
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qtensor.training import GroupedLinear, NVFP4TrainingRecipe

ROW = dict(row_scaled_activation=True, rht=False, weight_2d=False, stochastic_rounding=False)


def main(kind: str) -> None:
    recipe = NVFP4TrainingRecipe(**(ROW if kind == "row" else {}))
    experts, splits = 128, [512] * 128
    kw = dict(bias=False, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    fc1 = GroupedLinear(experts, 2048, 1536, **kw)
    fc2 = GroupedLinear(experts, 768, 2048, **kw)
    x = torch.randn(sum(splits), 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        gate, up = fc1(x, splits).chunk(2, -1)
        y = fc2(torch.nn.functional.silu(gate) * up, splits)
        y.float().square().mean().backward()
        with torch.no_grad():
            for m in (fc1, fc2):
                m.weight.sub_(m.weight.grad, alpha=1e-3)
                m.weight.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    print(kind, "ms/step", (time.perf_counter() - t) * 100)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table
    print(table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    print(table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "row")
