"""The training runs of `qtensor study`: the text, the configs, one run, the gradient errors.

The model is the built-in Llama-style transformer (qtensor/cli/models.py) over byte tokens
(vocabulary 256). Every run of one seed sees the same initial weights, the same batches in the
same order and the same validation batches, so configs differ only in their numerics. The
weights are fp32 masters under bf16 autocast, optimized by AdamW; the decoder linears are
quantized with `quantize_(model, TrainingConfig(recipe))` (the LM head stays in bf16, as in
Transformer Engine's recipes).

Gradient errors: at a few fixed steps the batch also runs, forward and backward, through two
replicas with the quantized model's current weights. For each decoder linear the relative error
||g - g_ref|| / ||g_ref|| of its weight gradient (the wgrad GEMM's output) and of its input
gradient (the dgrad GEMM's output) is recorded against each:
- the bf16 replica (no quantization): the whole error, the quantized forward's share included;
- the dequantized replica (the same recipe with backward_override="dequantized": the same
  quantized forward, and a backward of plain GEMMs on its dequantized operands): the error of
  the backward's own quantization, which is what the design documents measure.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sysconfig
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qtensor.cli.models import DemoConfig, build_demo_model

VOCAB = 256  # byte-level tokens
VALIDATION_EVERY = 20  # every 20th file (sorted) is held out: a fixed 5 %
WARMUP_STEPS = 3  # steps left out of tokens/s: the first ones compile kernels and fill caches


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes of one study: the model, the batches and the schedule."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    batch: int
    seq: int
    steps: int
    lr: float
    eval_every: int
    eval_batches: int
    grad_steps: tuple[int, ...]  # steps whose gradients are compared with the bf16 replica
    max_bytes: int  # text read, at most (the tiny preset needs a few MB, not the whole stdlib)

    def model_config(self) -> DemoConfig:
        return DemoConfig(vocab_size=VOCAB, hidden=self.hidden, layers=self.layers,
                          heads=self.heads, kv_heads=self.kv_heads,
                          intermediate=self.intermediate)


PRESETS = {
    # The CPU default (run in CI): 2 layers of width 64, 512 tokens per step, 24 steps; a few
    # seconds per run on 2 cores.
    "tiny": Preset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192, batch=8, seq=64,
                   steps=24, lr=3e-3, eval_every=12, eval_batches=2, grad_steps=(0, 23),
                   max_bytes=4 << 20),
    # The real study (GPU): 8 layers of width 512 (24M parameters), 8,192 tokens per step,
    # 8.2M tokens in all; a quantized config takes about 3.5 minutes on an H200.
    "full": Preset(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, batch=16,
                   seq=512, steps=1000, lr=1e-3, eval_every=50, eval_batches=8,
                   grad_steps=(0, 250, 999), max_bytes=1 << 40),
}


def _recipes() -> dict[str, Callable]:
    from qtensor.training import NVFP4TrainingRecipe as R

    return {
        "nvfp4": lambda: R(),
        "dgrad_mxfp8": lambda: R(dgrad_mxfp8=True),
        "high_precision_bwd": lambda: R(backward_override="high_precision"),
        "4over6": lambda: R(fourover6_roles="all", rht=False),
        "4over6_grad": lambda: R(fourover6_roles="all", fourover6_grad=True, rht=False,
                                 stochastic_rounding=False),
        "row_scaled": lambda: R(row_scaled_activation=True, rht=False, weight_2d=False,
                                stochastic_rounding=False),
    }


# Config name -> what it is, for the table and the docs. bf16 is the baseline.
CONFIGS = {
    "bf16": "bf16 autocast, no quantization (the baseline)",
    "nvfp4": "NVFP4 default recipe: 2D weight tiles, RHT on wgrad operands, SR of gradients",
    "dgrad_mxfp8": "NVFP4, with dgrad on MXFP8 operands (dgrad_mxfp8=True)",
    "high_precision_bwd": "NVFP4 forward, bf16 backward (backward_override='high_precision')",
    "4over6": "NVFP4 with 4over6 on weights and activations (RHT off)",
    "4over6_grad": "4over6 on weights, activations and gradients (RHT and SR off)",
    "row_scaled": "NVFP4 with per-token activation scales (RHT, 2D and SR off)",
}


# ---- the text ----------------------------------------------------------------------------------

def stdlib_files() -> list[Path]:
    """Every .py file of the running interpreter's standard library, sorted: its folder less
    the installed packages (site-packages) that may live inside it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    installed = {"site-packages", "dist-packages"}
    return sorted(p for p in root.rglob("*.py")
                  if p.is_file() and not installed & set(p.relative_to(root).parts))


def text_files(path: str | None) -> list[Path]:
    """The files of --data (a file, or every file of a folder, sorted), or the stdlib's."""
    if path is None:
        return stdlib_files()
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    raise FileNotFoundError(f"--data {path}: no such file or folder.")


def load_splits(files: list[Path], max_bytes: int, min_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 tensors: every VALIDATION_EVERY-th file is validation, the
    rest training, files read in order until each split has its share of `max_bytes` (all of
    them for the full preset). A single file is split 95/5 by bytes."""
    if len(files) == 1:
        data = files[0].read_bytes()[:max_bytes]
        cut = len(data) - max(len(data) // VALIDATION_EVERY, min_bytes)
        parts = (data[:cut], data[cut:])
    else:
        parts = ([], [])
        sizes = [0, 0]
        for i, f in enumerate(files):
            split = 1 if i % VALIDATION_EVERY == VALIDATION_EVERY - 1 else 0
            if sizes[split] >= (max_bytes // VALIDATION_EVERY if split else max_bytes):
                continue
            b = f.read_bytes()
            parts[split].append(b)
            sizes[split] += len(b)
        parts = tuple(b"\n".join(p) for p in parts)
    tensors = tuple(torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else
                    torch.zeros(0, dtype=torch.uint8) for p in parts)
    for name, t in zip(("training", "validation"), tensors):
        if t.numel() < min_bytes:
            raise ValueError(f"the {name} text has {t.numel()} bytes; a batch needs at least "
                             f"{min_bytes}. Pass a larger --data.")
    return tensors


def batch_at(data: torch.Tensor, generator: torch.Generator, batch: int, seq: int):
    """(inputs, targets) [batch, seq] at random offsets drawn from `generator`."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(seq + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


# ---- one run --------------------------------------------------------------------------------------

def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The quantized layers: every nn.Linear-like module inside the decoder blocks."""
    return {n: m for n, m in model.named_modules()
            if n.startswith("blocks.") and hasattr(m, "weight") and m.weight is not None
            and m.weight.dim() == 2}


class _InputGrads:
    """Records the gradient of each layer's own input: a forward pre-hook hands the layer a
    fresh view of its input and hooks that view, so layers that read one tensor (q, k and v)
    each get the gradient of their own GEMM."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.grads: dict[str, torch.Tensor] = {}
        self.active = False
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in layers.items()]

    def _hook(self, name):
        def pre(module, args):
            if not self.active or not args[0].requires_grad:
                return None
            x = args[0].view_as(args[0])
            x.register_hook(lambda g: self.grads.__setitem__(name, g.detach().float()))
            return (x,) + tuple(args[1:])
        return pre

    def remove(self):
        for h in self.handles:
            h.remove()


class _Reference:
    """A replica of the model that recomputes a batch's gradients: the weights of the model
    under test are copied in first (a copy bumps the version counters, so a quantized
    replica's weight cache rebuilds)."""

    def __init__(self, replica: nn.Module):
        self.model = replica
        self.layers = decoder_linears(replica)
        self.hooks = _InputGrads(self.layers)

    def gradients(self, model: nn.Module, x, y) -> tuple[float, dict]:
        """(loss, {layer: (weight gradient, input gradient)}) of the batch at model's weights."""
        with torch.no_grad():
            weights = dict(model.named_parameters())
            for name, p in self.model.named_parameters():
                p.copy_(weights[name])
        self.model.zero_grad(set_to_none=True)
        self.hooks.active = True
        loss = _loss(self.model, x, y)
        loss.backward()
        self.hooks.active = False
        return loss.item(), {n: (m.weight.grad, self.hooks.grads[n]) for n, m in self.layers.items()}

    def remove(self):
        self.hooks.remove()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.float().norm().item()
    return (a.float() - ref.float()).norm().item() / den if den > 0 else 0.0


def _loss(model, x, y) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def _val_loss(model, batches) -> float:
    return sum(_loss(model, x, y).item() for x, y in batches) / len(batches)


def train_one(config: str, seed: int, preset: Preset, data, device: torch.device,
              progress=None) -> dict:
    """Train `config` from the seed's initial weights; its curves, speed and gradient errors."""
    from qtensor import quantize_
    from qtensor.training import TrainingConfig

    train, val = data
    model = build_demo_model(preset.model_config(), seed=seed, dtype=torch.float32,
                             device=device).train()
    names = set(decoder_linears(model))
    refs = {"": _Reference(copy.deepcopy(model))}  # the bf16 replica
    if config != "bf16":
        recipe = dataclasses.replace(_recipes()[config](), seed=seed)
        # The same forward operands, the backward on their dequantized values.
        deq = copy.deepcopy(model)
        quantize_(deq, TrainingConfig(dataclasses.replace(
            recipe, backward_override="dequantized", dgrad_mxfp8=False)),
            filter_fn=lambda m, n: n in names)
        refs["bwd_"] = _Reference(deq)
        quantize_(model, TrainingConfig(recipe), filter_fn=lambda m, n: n in names)
    layers = decoder_linears(model)
    hooks = _InputGrads(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=preset.lr, weight_decay=0.1, betas=(0.9, 0.95))
    batches = torch.Generator().manual_seed(1000 + seed)
    val_gen = torch.Generator().manual_seed(2000 + seed)
    val_batches = [tuple(t.to(device) for t in batch_at(val, val_gen, preset.batch, preset.seq))
                   for _ in range(preset.eval_batches)]
    out = {"config": config, "seed": seed, "device": str(device), "train_loss": [],
           "val_loss": [], "grad_error": []}
    out["val_loss"].append([0, _val_loss(model, val_batches)])  # at the initial weights
    tokens, seconds = 0, 0.0
    for step in range(preset.steps):
        x, y = (t.to(device) for t in batch_at(train, batches, preset.batch, preset.seq))
        # Linear warm-up over 10 steps, then a cosine decay to zero.
        lr = preset.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / preset.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        measure = step in preset.grad_steps
        hooks.active = measure
        _sync(device)
        t0 = time.perf_counter()
        loss = _loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        if measure:  # outside the timed step
            hooks.active = False
            out["grad_error"].append(_grad_errors(step, loss.item(), layers, hooks, refs,
                                                  model, x, y))
        t2 = time.perf_counter()
        opt.step()
        _sync(device)
        if step >= WARMUP_STEPS or preset.steps <= WARMUP_STEPS:
            seconds += (t1 - t0) + (time.perf_counter() - t2)
            tokens += x.numel()
        out["train_loss"].append([step, loss.item()])
        if (step + 1) % preset.eval_every == 0 or step + 1 == preset.steps:
            out["val_loss"].append([step + 1, _val_loss(model, val_batches)])
        if progress is not None:
            progress.update(1)
    hooks.remove()
    for ref in refs.values():
        ref.remove()
    out["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return out


def _grad_errors(step, loss, layers, hooks, refs, model, x, y) -> dict:
    """Per layer: the relative errors of this step's weight and input gradients against each
    reference's on the same batch and weights ("wgrad", "dgrad" against bf16; "bwd_wgrad",
    "bwd_dgrad" against the dequantized backward), and each reference's loss (the dequantized
    replica's equals the model's: the same forward)."""
    record = {"step": step, "loss": loss, "layers": {name: {} for name in layers}}
    for prefix, ref in refs.items():
        record[f"{prefix}ref_loss"], grads = ref.gradients(model, x, y)
        for name, m in layers.items():
            w_ref, x_ref = grads[name]
            record["layers"][name][f"{prefix}wgrad"] = _rel(m.weight.grad, w_ref)
            record["layers"][name][f"{prefix}dgrad"] = _rel(hooks.grads[name], x_ref)
    return record


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
