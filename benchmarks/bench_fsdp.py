"""FSDP2 training step time: bf16 against the NVFP4 recipe (quantize before the all-gather).

Two ranks train the same Llama-style block stack (qtensor's demo transformer, fp32 master
weights, AdamW), one FSDP module per block and the root:
  bf16         FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): every
               parameter all-gathered in bf16, bf16 GEMMs
  nvfp4        NVFP4TrainingRecipe() on every block linear, quantize_on_gather: each weight
               all-gathered as NVFP4 (0.5625 B per element), its dgrad side derived after the
               gather ([Note: quantize before the all-gather], qtensor/distributed/master.py)
  dgrad_mxfp8  the same with NVFP4TrainingRecipe(dgrad_mxfp8=True) (MXFP8 dgrad)
The embedding, the norms and the LM head take FSDP2's bf16 path in every configuration.

All configurations are built in the same processes and timed side by side: each timed round
runs one step of each, in turn, so the ratios compare steps under the same machine state.
A step is precompute_amaxes (quantized rows), forward, backward, optimizer step; its time is
the wall time from a barrier to the end of the step (CUDA synchronised), the slower rank's,
median over --iters rounds after --warmup. "all-gather MB" counts, per rank and step, the
inputs of the all-gather collective FSDP2 calls (forward and the backward's re-gather:
qtensor.testing.collectives), so it is device-independent; "blocks' all-gather" is one
all-gather of every block (linears and norms; not the embedding and LM head) against bf16's.

    python benchmarks/bench_fsdp.py --tiny                    # CPU, gloo, seconds
    python benchmarks/bench_fsdp.py --device cuda --out r.md  # 2 GPUs, NCCL

Prints one markdown row per configuration; --out also writes them to a file.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qtensor.cli.models import DemoConfig, build_demo_model
from qtensor.testing.collectives import CollectiveCounter, gather_report
from qtensor.testing.launch import run_local

CONFIGS = {"bf16": None, "nvfp4": {}, "dgrad_mxfp8": {"dgrad_mxfp8": True}}
# Llama-like widths; every block weight's dim 0 splits into 16-row-aligned (and, for MXFP8
# dgrad, 32-row) shards over 2 ranks. "tiny" is what CI's CPU can step in well under a second.
SIZES = {
    "tiny": (DemoConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2,
                        intermediate=128), 2, 64),
    "llama-4096": (DemoConfig(vocab_size=32000, hidden=4096, layers=4, heads=32, kv_heads=8,
                              intermediate=11008), 4, 2048),
}


def build(name: str, cfg: DemoConfig, device: torch.device) -> nn.Module:
    """One configuration's sharded model, from seed 0 (FSDP2 broadcasts nothing)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchao.quantization import quantize_

    from qtensor.distributed import fully_shard, quantize_on_gather
    from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

    model = build_demo_model(cfg, seed=0, dtype=torch.float32, device=device).train()
    if CONFIGS[name] is not None:
        quantize_(model, TrainingConfig(NVFP4TrainingRecipe(**CONFIGS[name])),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
        quantize_on_gather(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def step(model, opt, tokens, quantized: bool) -> torch.Tensor:
    from qtensor.distributed import precompute_amaxes

    if quantized:
        precompute_amaxes(model)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def timed(fn, device: torch.device) -> float:
    """Seconds from a barrier to the end of fn(), the slower rank's."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench(rank: int, world: int, size: str, device_type: str, warmup: int, iters: int) -> dict:
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    cfg, batch, seq = SIZES[size]
    models = {n: build(n, cfg, device) for n in CONFIGS}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
    from qtensor.distributed import precompute_amaxes

    out = {n: {"times": [], "losses": []} for n in CONFIGS}
    for n in CONFIGS:  # one counted step each: what the collective moves per step
        with CollectiveCounter() as counter:
            out[n]["losses"].append(float(step(models[n], opts[n], tokens, n != "bf16")))
        out[n]["gather_bytes"] = sum(counter.bytes)
        if n != "bf16":
            precompute_amaxes(models[n])
        # One all-gather of each block (its linears and norms), without the embedding and head.
        out[n]["block_bytes"] = sum(r.moved for r in gather_report(models[n])
                                    if r.module.startswith("blocks."))
    for i in range(warmup + iters):
        for n in CONFIGS:
            holder = {}
            t = timed(lambda: holder.update(loss=step(models[n], opts[n], tokens, n != "bf16")),
                      device)
            out[n]["losses"].append(float(holder["loss"]))
            if i >= warmup:
                out[n]["times"].append(t)
    out["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    return out


def rows(res: dict, size: str, world: int, backend: str) -> list[str]:
    cfg, batch, seq = SIZES[size]
    base_ms = statistics.median(res["bf16"]["times"]) * 1e3
    bytes_base, blocks_base = res["bf16"]["gather_bytes"], res["bf16"]["block_bytes"]
    head = [f"<!-- bench_fsdp.py: {res['device']}, {world} ranks over {backend}, {size}: "
            f"{cfg.layers} blocks, hidden {cfg.hidden}, intermediate {cfg.intermediate}, vocab "
            f"{cfg.vocab_size}; {batch}x{seq} tokens per rank and step -->",
            "| config | step ms (median) | vs bf16 | all-gather MB per rank and step | vs bf16 "
            "| blocks' all-gather vs bf16 | loss first -> last |",
            "|---|---|---|---|---|---|---|"]
    out = []
    for n in CONFIGS:
        r = res[n]
        ms = statistics.median(r["times"]) * 1e3
        out.append(f"| {n} | {ms:.1f} | {ms / base_ms:.2f}x | {r['gather_bytes'] / 1e6:.3f} "
                   f"| {r['gather_bytes'] / bytes_base:.3f} | "
                   f"{r['block_bytes'] / blocks_base:.3f} | {r['losses'][0]:.3f} -> "
                   f"{r['losses'][-1]:.3f} |")
    return head + out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo; cuda: NCCL, one GPU per rank")
    ap.add_argument("--tiny", "--quick", action="store_true", help="the tiny size (CI, CPU)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="default: tiny on the CPU, llama-4096 on GPUs")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    size = "tiny" if args.tiny else args.size or ("llama-4096" if args.device == "cuda"
                                                  else "tiny")
    backend = "nccl" if args.device == "cuda" else "gloo"
    res = run_local(bench, args.nproc, size, args.device, args.warmup, args.iters,
                    backend=backend)[0]
    lines = rows(res, size, args.nproc, backend)
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
