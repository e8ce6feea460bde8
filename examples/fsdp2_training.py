"""FSDP2 training with the NVFP4 `dgrad_mxfp8` recipe: a small Llama-style model on N processes.

The model is qtensor's built-in transformer (qtensor/cli/models.py) with seeded fp32 master weights.
torchao's `quantize_` with `TrainingConfig(NVFP4TrainingRecipe(dgrad_mxfp8=True))` turns every
block linear into a TrainingLinear (NVFP4 fprop and wgrad; dgrad with an MXFP8 grad_output and
the NVFP4 weight requantized to MXFP8); the LM head stays high precision. The model is sharded
with FSDP2 through qtensor's quantize-before-all-gather path (docs/fsdp2.md):

  - `quantize_on_gather(model)`: each TrainingLinear's master weight stays fp32 and sharded;
    FSDP2 all-gathers it as NVFP4 (0.5625 bytes per element, 0.14x the fp32 master), quantized
    with the whole weight's amax, and the MXFP8 dgrad side is built after the gather;
  - `fully_shard` per block, then the root (qtensor's: torch's, after checking the shards);
  - `precompute_amaxes(model)` before every forward: all weights' global amaxes in ONE
    all-reduce. The other parameters (embedding, norms, LM head) take FSDP2's ordinary path.

Each rank trains on its own batch of random token chains (token t+1 = perm[token t] for a fixed
random permutation, so the loss can fall) drawn from a fixed seed; AdamW updates the master
shards. Rank 0 prints the loss (the mean over ranks) per step. At the end the script checks that
the loss fell, and all-gathers every full parameter on every rank and checks that all ranks hold
the same bytes.

    python examples/fsdp2_training.py --nproc 2                 # CPU, gloo, the "small" model
    python examples/fsdp2_training.py --nproc 2 --device cuda   # one GPU per process, NCCL
    python examples/fsdp2_training.py --nproc 2 --size tiny --steps 8   # what CI runs
    torchrun --nproc-per-node 2 examples/fsdp2_training.py      # launched by torchrun instead

On a CPU every quantized GEMM runs on qtensor's exact emulated reference: 20 steps of "small"
took 24 s on 2 shared cores (2026-11-30), 8 steps of "tiny" 11 s, most of it process start-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchao.quantization import quantize_

from qtensor.cli.models import DemoConfig, build_demo_model
from qtensor.distributed import fully_shard, precompute_amaxes, quantize_on_gather
from qtensor.testing.launch import drain, free_port
from qtensor.training import NVFP4TrainingRecipe, TrainingConfig

RECIPE = NVFP4TrainingRecipe(dgrad_mxfp8=True)  # 2D weight tiles, RHT and SR on gradients

# Every quantized weight's dim 0 splits into shards of a multiple of 16 rows over 2 ranks
# (whole 16x16 tiles: 32 k/v rows at tiny) and is a multiple of 32 (MXFP8 dgrad blocks).
# Learning rates: at "small", 3e-3 made the loss climb from 6.9 to 7.2 over steps 3-4 (2 ranks,
# CPU); 1e-3 falls steadily. "tiny" falls from 5.6 to 3.6 in 8 steps at 3e-3.
LR = {"tiny": 3e-3, "small": 1e-3}
SIZES = {
    "tiny": DemoConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2,
                       intermediate=128),
    "small": DemoConfig(vocab_size=1024, hidden=256, layers=4, heads=8, kv_heads=4,
                        intermediate=704),
}


def build(cfg: DemoConfig, seed: int, device: torch.device) -> nn.Module:
    """The sharded model. FSDP2 does not broadcast weights: every rank builds the same ones from
    the seed, then keeps its shard."""
    model = build_demo_model(cfg, seed=seed, dtype=torch.float32, device=device).train()
    quantize_(model, TrainingConfig(RECIPE),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    quantize_on_gather(model)  # before fully_shard and before the optimizer
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def token_chains(vocab: int, batch: int, seq: int, perm: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
    """[batch, seq + 1] tokens: a random start, then token t+1 = perm[token t]."""
    tokens = [torch.randint(0, vocab, (batch,), generator=generator)]
    for _ in range(seq):
        tokens.append(perm[tokens[-1]])
    return torch.stack(tokens, dim=1)


def train_step(model, opt, tokens: torch.Tensor) -> torch.Tensor:
    precompute_amaxes(model)  # after every optimizer step: the weights changed
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def full_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter all-gathered to its full shape, flattened into one fp32 vector: the
    high-precision masters (what a checkpoint saves), never the NVFP4 operands."""
    fulls = []
    for p in model.parameters():
        full = p.full_tensor()
        fulls.append(getattr(full, "_data", full).detach().reshape(-1).float())
    return torch.cat(fulls)


def check(ok: bool, what: str, rank: int) -> bool:
    if rank == 0:
        print(f"{what}: {'yes' if ok else 'NO'}", flush=True)
    return ok


def train(rank: int, world: int, args) -> bool:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else \
        torch.device("cpu")
    cfg = SIZES[args.size]
    model = build(cfg, args.seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr or LR[args.size], weight_decay=0.01)
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(args.seed))
    data = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    if rank == 0:
        print(f"{world} ranks on {device.type}, {args.size} model ({cfg.layers} layers, hidden "
              f"{cfg.hidden}), batch {args.batch}x{args.seq} per rank; recipe {RECIPE}",
              flush=True)
        up = model.blocks[0].mlp.up_proj.weight  # a DTensor around this rank's fp32 rows
        print(f"blocks.0.mlp.up_proj.weight {tuple(up.shape)}: rank 0 holds "
              f"{type(up.to_local()).__name__} {tuple(up.to_local().shape)} {up.dtype}, "
              "all-gathered as NVFP4", flush=True)
    losses = []
    for step in range(args.steps):
        tokens = token_chains(cfg.vocab_size, args.batch, args.seq, perm, data).to(device)
        start = time.perf_counter()
        loss = train_step(model, opt, tokens)
        dist.all_reduce(loss)  # SUM: gloo has no AVG
        loss = loss.item() / world
        losses.append(loss)
        if rank == 0:
            print(f"step {step + 1:3d}/{args.steps}  loss {loss:.4f}  "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)

    mine = full_parameters(model)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    ok = check(losses[-1] < losses[0], f"loss decreased ({losses[0]:.4f} -> {losses[-1]:.4f})",
               rank)
    ok &= check(bool(mine.isfinite().all()), f"all {mine.numel():,} parameters finite", rank)
    ok &= check(all(torch.equal(every[0], other) for other in every),
                f"all {world} ranks hold identical full parameters", rank)
    return ok


def worker(rank: int, world: int, args) -> None:
    """One rank. Spawned by main(), or started by torchrun (which sets the same variables)."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        # The ranks share the machine's cores; oversubscribing them slows gloo by ~10x.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method="env://",
                            rank=rank, world_size=world)
    try:
        ok = train(rank, world, args)
        drain()  # free every finished all-gather before the interpreter exits
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) to spawn")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per rank")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (default: per --size)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 to see the loss move; got {args.steps}.")
    if (args.batch * args.seq) % 16:
        p.error(f"--batch x --seq must be a multiple of 16 (NVFP4 wgrad blocks run along "
                f"tokens); got {args.batch} x {args.seq}.")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        p.error(f"--device cuda with --nproc {args.nproc} needs {args.nproc} GPUs; this "
                f"machine has {torch.cuda.device_count()}. Lower --nproc or use --device cpu.")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if "LOCAL_RANK" in os.environ:  # torchrun started this process: it is one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
    except mp.ProcessExitedException as err:  # a failed check (SystemExit(1)) or a crash
        print(f"a rank failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
