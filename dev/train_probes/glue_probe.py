"""Where a training linear's step spends host time outside its casts and products: the autograd
function's forward and backward bodies called directly, against `apply` and the engine's
backward, and the pieces around them (seed advance, weight cache, autocast switch, a function
that saves a HybridTensor). Host microseconds a call, issued 200 times, synchronized once; then
a cProfile of the backward body run in the main thread (the engine runs it in its device thread,
where a profiler started in the main thread sees nothing).

    python dev/train_probes/glue_probe.py [cuda|cpu]
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from host_probe import host_us  # noqa: E402
from bench_overhead import profile as cprofile  # noqa: E402
from bench_training import RECIPES, update_step  # noqa: E402

from qtensor.training import NVFP4TrainingRecipe, TrainingLinear  # noqa: E402
from qtensor.training.linear import (TrainingLinearFunction, WeightHolder,  # noqa: E402
                                     forward_input, quantize_weight, take_sr_state)
from qtensor.training.roles import dgrad, fprop, quantize_role, sr_for_role, wgrad  # noqa: E402

TOKENS, K, N = 256, 512, 1408


class SavesOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, holder):
        ctx.save_for_backward(holder.op)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return g, None


class SavesNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, holder):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}; host us a call at {TOKENS} tokens, {K} -> {N}")
    torch.manual_seed(0)
    kw = dict(bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(TOKENS, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, N, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(K, N, **kw)
    mod = TrainingLinear(K, N, recipe=NVFP4TrainingRecipe(**RECIPES["nvfp4"]), **kw)
    specs, st = mod.state.specs, mod.state
    w_op = mod.weight_cache.get(mod.weight, lambda w: quantize_weight(w, specs))
    sr = mod.sr_state.clone()
    x2 = x.detach()
    x_op = forward_input(x2, st, True, sr=sr)
    dy_op = quantize_role(dy, specs.grad_output, "grad_output",
                          sr_for_role("grad_output", specs.grad_output, sr))
    holder = WeightHolder(w_op)

    def apply():
        return TrainingLinearFunction.apply(x, mod.weight, None, holder, st, torch.bfloat16,
                                            True, sr)

    # The forward body on a stand-in ctx, in the main thread.
    fctx = SimpleNamespace(needs_input_grad=(True, True, False),
                           save_for_backward=lambda *t: None)

    def forward_body():
        return TrainingLinearFunction.forward(fctx, x2, mod.weight, None, holder, st,
                                              torch.bfloat16, True, sr)

    bctx = SimpleNamespace(saved_tensors=(x_op, w_op, sr), x_meta=(x.shape, x.dtype),
                           needs_input_grad=(True, True, False, False), weight=None,
                           w_dtype=torch.bfloat16, dtype=torch.bfloat16, state=st, b_dtype=None)

    def backward_body():
        return TrainingLinearFunction.backward(bctx, dy)

    rows = {
        "bf16 nn.Linear step": host_us(update_step(lin, lambda m: m(x), dy)),
        "TrainingLinear step": host_us(update_step(mod, lambda m: m(x), dy)),
        "module forward, weight cached": host_us(lambda: mod(x)),
        "module forward + backward, weight cached": host_us(lambda: mod(x).backward(dy)),
        "apply": host_us(apply),
        "apply + backward": host_us(lambda: apply().backward(dy)),
        "forward body, main thread": host_us(forward_body),
        "backward body, main thread": host_us(backward_body),
        "forward_input (input cast)": host_us(lambda: forward_input(x2, st, True, sr=sr)),
        "fprop": host_us(lambda: fprop(x_op, w_op, None, torch.bfloat16)),
        "grad_output cast": host_us(lambda: quantize_role(
            dy, specs.grad_output, "grad_output",
            sr_for_role("grad_output", specs.grad_output, sr))),
        "dgrad": host_us(lambda: dgrad(dy_op, w_op, torch.bfloat16)),
        "wgrad": host_us(lambda: wgrad(dy_op, x_op, torch.bfloat16)),
        "take_sr_state": host_us(lambda: take_sr_state(mod, x)),
        "weight_cache.get (hit)": host_us(
            lambda: mod.weight_cache.get(mod.weight, lambda w: quantize_weight(w, specs))),
        "autocast(enabled=False) enter/exit": host_us(
            lambda: torch.autocast(dev, enabled=False).__enter__().__exit__(None, None, None)),
        "Function saving a HybridTensor, + backward": host_us(
            lambda: SavesOne.apply(x, WeightHolder(x_op)).backward(dy[:, :K])),
        "Function saving nothing, + backward": host_us(
            lambda: SavesNone.apply(x, WeightHolder(x_op)).backward(dy[:, :K])),
        "bf16 x @ w.t() + backward": host_us(lambda: (x @ lin.weight.t()).backward(dy)),
    }
    with torch.autograd.set_multithreading_enabled(False):
        rows["module forward + backward, backward in the main thread"] = host_us(
            lambda: mod(x).backward(dy))
        rows["TrainingLinear step, backward in the main thread"] = host_us(
            update_step(mod, lambda m: m(x), dy))
    for piece, us in rows.items():
        print(f"| {piece} | {us:.1f} |", flush=True)
    # cProfile inside the engine's thread: started and stopped by hooks on the function's node.
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    for _ in range(3):
        mod(x).backward(dy)
    for _ in range(50):
        y = mod(x)
        node = y.grad_fn
        node.register_prehook(lambda g: prof.enable())
        node.register_hook(lambda gi, go: prof.disable())
        y.backward(dy)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print("cProfile of the engine's backward (50 calls)")
    print(buf.getvalue())
    print("cProfile of the backward body in the main thread")
    cprofile(backward_body, calls=50, top=30)
    print("cProfile of the forward body")
    cprofile(forward_body, calls=50, top=30)


if __name__ == "__main__":
    main()
