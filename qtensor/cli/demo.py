"""`qtensor demo`: the built-in transformer under every config, in one table.

Builds the seeded Llama-style model of qtensor.cli.models in bf16, quantizes a deep copy with
each config of qtensor.quantize, runs one batch through each, and prints per config: the stored
bytes of the quantized Linear weights (codes + scales + amax) against the same weights in bf16,
the SQNR of the logits against the bf16 model, and the time to quantize and to run. On a CPU the
products run on the exact emulated GEMM, so the times say what the reference costs, not what a
GPU kernel does.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from qtensor.cli.common import (UsageError, add_model_args, check_batch, configs_from_args,
                         demo_config, resolve_device)
from qtensor.ops import gemm_ops


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="quantize the built-in transformer with every config",
                       description=__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(run=run)


@dataclasses.dataclass
class DemoRow:
    config: str
    description: str
    weight_bytes: int  # stored bytes of the Linear weights (quantized ones, or bf16 for bf16)
    bf16_weight_bytes: int  # the same weights in bf16
    sqnr_db: float | None  # logits vs the bf16 model; None for the bf16 row itself
    quantize_s: float | None
    forward_s: float
    backends: str = "-"  # quant/gemm backends the quantized weights resolved, e.g. "cpu/emulated"
    layers: str = "-"  # quantized / all nn.Linear layers, e.g. "13/15" (the bytes count those)


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def _forward(model, tokens):
    """(output, seconds) of the second forward: the first pays one-time setup (allocator,
    oneDNN primitives), ~0.6 s on 2 CPU cores, which would dominate a model this small."""
    with torch.no_grad():
        model(tokens)
        return _timed(model, tokens)


def demo_rows(model, tokens, configs, skip_incompatible=False) -> list[DemoRow]:
    from qtensor.cli.analyze import linear_layers, quantized_copy, quantized_weight_bytes, sqnr_db

    ref, ref_s = _forward(model, tokens)
    hp_bytes = sum(m.weight.numel() * 2 for _, m in linear_layers(model))
    rows = [DemoRow("bf16", "the unquantized model", hp_bytes, hp_bytes, None, None, ref_s)]
    for named in configs:
        try:
            qmodel, q_s = _timed(quantized_copy, model, named, skip_incompatible)
        except ValueError as e:
            raise UsageError(str(e)) from None
        out, f_s = _forward(qmodel, tokens)
        stored, bf16 = quantized_weight_bytes(qmodel)
        rows.append(DemoRow(named.name, named.description, stored, bf16,
                            sqnr_db(ref.float(), out.float()), q_s, f_s, _backends(qmodel),
                            _layer_count(qmodel)))
    return rows


def _layer_count(model) -> str:
    """'quantized/all' nn.Linear layers: with --skip-incompatible some stay in bf16, and the
    weight bytes cover only the quantized ones."""
    from qtensor.cli.analyze import linear_layers
    from qtensor.tensors import QuantizedTensor

    layers = [m for _, m in linear_layers(model)]
    done = sum(isinstance(m.weight, QuantizedTensor) for m in layers)
    return f"{done}/{len(layers)}"


def _backends(model) -> str:
    """'quant/gemm' backend names of the quantized weights (several joined by ',')."""
    from qtensor.cli.analyze import linear_layers

    found = sorted({f"{m.weight.quant_backend}/{m.weight.gemm_backend}"
                    for _, m in linear_layers(model) if hasattr(m.weight, "gemm_backend")})
    return ",".join(found) or "-"


def format_table(rows: list[DemoRow]) -> str:
    head = (f"{'config':<17}{'layers':>8}{'weights MiB':>12}{'vs bf16':>9}{'SQNR dB':>9}"
            f"{'quant s':>9}{'run s':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r.weight_bytes / r.bf16_weight_bytes if r.bf16_weight_bytes else float("nan")
        sqnr = "-" if r.sqnr_db is None else f"{r.sqnr_db:.2f}"
        quant = "-" if r.quantize_s is None else f"{r.quantize_s:.2f}"
        lines.append(f"{r.config:<17}{r.layers:>8}{r.weight_bytes / 2**20:>12.3f}{ratio:>8.3f}x"
                     f"{sqnr:>9}{quant:>9}{r.forward_s:>8.2f}")
    return "\n".join(lines)


def run(args) -> int:
    device = resolve_device(args.device)
    check_batch(args)
    cfg = demo_config(args)
    configs = configs_from_args(args)
    if configs is None:
        return 0
    from qtensor.cli.models import build_demo_model, demo_tokens

    start = time.perf_counter()
    model = build_demo_model(cfg, seed=args.seed, device=device)
    tokens = demo_tokens(cfg, args.batch, args.seq, seed=args.seed, device=device)
    rows = demo_rows(model, tokens, configs, args.skip_incompatible)
    total_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    meta = {"model": dataclasses.asdict(cfg), "parameters": params, "dtype": "bfloat16",
            "batch": args.batch, "seq": args.seq, "device": str(device), "seed": args.seed,
            "total_s": total_s}
    if args.json:
        print(json.dumps({**meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
        return 0
    print(f"qtensor demo: Llama-style transformer, {cfg.layers} layers, hidden {cfg.hidden}, "
          f"vocab {cfg.vocab_size} ({params / 1e6:.2f}M parameters), bf16, seed {args.seed}; "
          f"batch {args.batch} x {args.seq} tokens on {device}")
    print(format_table(rows))
    print(f"layers: nn.Linear layers quantized / all. weights: stored bytes of the quantized "
          f"nn.Linear weights (codes + scales + amax) vs the same weights in bf16 (layers left "
          f"in bf16 are not counted).\nSQNR: logits vs the bf16 model (+6 dB = one more bit). "
          f"run s: the second forward of the batch.\n"
          f"{_backend_note(rows, args.batch * args.seq, device)}\n"
          f"total {total_s:.1f} s")
    return 0


def _backend_note(rows: list[DemoRow], tokens: int, device: torch.device) -> str:
    used = sorted({b for r in rows[1:] for b in r.backends.split(",") if b != "-"})
    note = f"backends (quantize/GEMM): {', '.join(used) or '-'}."
    if not (used and all(b.endswith("/emulated") for b in used)):
        return note
    limit = gemm_ops.cpu_fused_max_m() if device.type == "cpu" else 0
    if tokens <= limit:
        return note + (f" The emulated GEMM runs the CPU kernels: up to {limit} rows the weight "
                       "is decoded in registers, the exact values summed in fp32.")
    return note + (" The emulated GEMM decodes the weights to their exact fp32 values once and "
                   "calls torch.matmul" + (f" (the CPU kernels decode in registers up to {limit} "
                                           f"rows; this batch has {tokens})" if limit else "")
                   + ".")
