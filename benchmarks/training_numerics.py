"""Backward error of the NVFP4 training recipe on a small transformer (seed 000's table, on CPU).

A 2-layer transformer is trained in fp32 on a synthetic second-order Markov task (each token is a
fixed function of the two before it with probability 0.8, else uniform: loss floor about 1.3
nats, start 4.85) until the loss is well below its start. Its block linears (qkv, proj, fc1,
fc2) then take the recipe through quantize_; the forward is the seed's RL forward (row-scaled
NVFP4 activations, 1D NVFP4 weights, no RHT / stochastic rounding / 2D). For each backward
configuration, one full-batch gradient of all block weights is compared with the
`backward_override="dequantized"` gradient:

    rel. err = |g - g_deq| / |g_deq|,    R = |g - g_deq| / noise,    noise = |g_A - g_B| / 2

where g_A, g_B are the dequantized-override gradients of the two half batches (the sampling
noise of the full-batch gradient). Two losses: SFT (cross-entropy on the data) and an RL
policy-gradient loss (32 prompts x 8 samples drawn from the model, reward = matches with the
data on the last 16 positions, advantages normalized per prompt group).

Run: python benchmarks/training_numerics.py [--steps 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _common import RL_FORWARD as RL_FWD
from _common import mxfp8_backward_specs
from torch import nn

from qtensor.training import NVFP4TrainingRecipe, TrainingLinear
from qtensor.training.linear import LinearState

VOCAB, D, HEADS, LAYERS, SEQ = 128, 128, 4, 2, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, HEADS, D // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, D), nn.Parameter(torch.zeros(SEQ, D))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


def make_data(n: int, gen: torch.Generator, table: torch.Tensor) -> torch.Tensor:
    seq = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    for t in range(2, SEQ):
        det = table[seq[:, t - 2], seq[:, t - 1]]
        keep = torch.rand(n, generator=gen) < 0.8
        seq[:, t] = torch.where(keep, det, seq[:, t])
    return seq


def sft_loss(model, seq):
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def train(model, table, steps, gen):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        loss = sft_loss(model, make_data(64, gen, table))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  train step {step:4d}  loss {loss.item():.3f}", flush=True)
    return loss.item()


def rl_batch(model, gen, table, prompts=32, samples=8):
    """Sequences (one per sample), sampled tokens for the last 16 positions, advantages."""
    seq = make_data(prompts, gen, table).repeat_interleave(samples, 0)
    with torch.no_grad():
        probs = model(seq[:, :-1])[:, -16:].softmax(-1)
    picks = torch.multinomial(probs.reshape(-1, VOCAB), 1, generator=gen).view(-1, 16)
    reward = (picks == seq[:, -16:]).float().sum(1).view(prompts, samples)
    adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    return seq, picks, adv.reshape(-1)


def rl_loss(model, batch):
    seq, picks, adv = batch
    logp = model(seq[:, :-1])[:, -16:].log_softmax(-1).gather(-1, picks[..., None])[..., 0]
    return -(adv[:, None] * logp).sum(1).mean()


CONFIGS = {
    "high precision (override)": dict(backward_override="high_precision"),
    "MXFP8 dgrad + wgrad": "mxfp8",
    "dgrad_mxfp8": dict(dgrad_mxfp8=True),
    "NVFP4 dgrad + wgrad": dict(),
    "NVFP4, fourover6_grad (256)": dict(fourover6_grad=True),
    "NVFP4, fourover6_grad (448)": dict(fourover6_grad=True, fourover6_e4m3_256_roles="none"),
    "dgrad_mxfp8, fourover6_grad": dict(dgrad_mxfp8=True, fourover6_grad=True),
}


def to_training(model, recipe, specs=None):
    """Swap every block linear for a TrainingLinear sharing its Parameters."""
    for i, blk in enumerate(model.blocks):
        for j, name in enumerate(("qkv", "proj", "fc1", "fc2")):
            # A TrainingLinear is an nn.Linear: re-wrapping it shares the same Parameters.
            new = TrainingLinear.from_linear(getattr(blk, name), recipe, seed_index=4 * i + j)
            if specs is not None:
                new.state = LinearState(specs, new.state.seeds)
            setattr(blk, name, new)


def block_grad(model, loss_fn, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    return torch.cat([getattr(b, n).weight.grad.flatten() for b in model.blocks
                      for n in ("qkv", "proj", "fc1", "fc2")])


def half(batch, which, loss):
    if loss == "sft":
        n = batch.shape[0] // 2
        return batch[:n] if which == 0 else batch[n:]
    seq, picks, adv = batch
    n = seq.shape[0] // 2
    sl = slice(0, n) if which == 0 else slice(n, None)
    return seq[sl], picks[sl], adv[sl]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=gen)
    model = TinyLM()
    t0 = time.time()
    final = train(model, table, args.steps, gen)
    batches = {"sft": make_data(256, gen, table), "rl": rl_batch(model, gen, table)}
    losses = {"sft": sft_loss, "rl": rl_loss}
    lines = [f"trained {args.steps} steps, final SFT loss {final:.3f} (uniform: 4.852)"]
    ref_recipe = NVFP4TrainingRecipe(backward_override="dequantized", **RL_FWD)
    to_training(model, ref_recipe)
    ref, noise = {}, {}
    for name, batch in batches.items():
        ref[name] = block_grad(model, losses[name], batch)
        g_a = block_grad(model, losses[name], half(batch, 0, name))
        g_b = block_grad(model, losses[name], half(batch, 1, name))
        noise[name] = ((g_a - g_b).norm() / 2).item()
        lines.append(f"{name}: sampling noise / |g| = {noise[name] / ref[name].norm().item():.3f}")
    lines.append(f"{'backward':32s} {'RL rel.err':>10s} {'RL R':>6s} {'SFT rel.err':>11s} "
                 f"{'SFT R':>6s}")
    for cname, cfg in CONFIGS.items():
        if cfg == "mxfp8":
            recipe = NVFP4TrainingRecipe(**RL_FWD)
            to_training(model, recipe, mxfp8_backward_specs(recipe))
        else:
            to_training(model, NVFP4TrainingRecipe(**RL_FWD, **cfg))
        row = []
        for name in ("rl", "sft"):
            g = block_grad(model, losses[name], batches[name])
            err = (g - ref[name]).norm().item()
            row += [err / ref[name].norm().item(), err / noise[name]]
        lines.append(f"{cname:32s} {row[0]:10.3f} {row[1]:6.2f} {row[2]:11.3f} {row[3]:6.2f}")
        print(lines[-1], flush=True)
    lines.append(f"{time.strftime('%Y-%m-%d')}, wall time {time.time() - t0:.0f} s, torch "
                 f"{torch.__version__}, CPU (emulated GEMMs)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
