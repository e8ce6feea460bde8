"""`qtensor analyze`: a per-layer numerics report of a model under a list of configs.

The model is the built-in Llama-style transformer (sizes from the options), or a Hugging Face
transformers causal LM from a local directory (`--model DIR` with a config.json, and its
weights if present; nothing is downloaded). The report (report.md, report.json and PNG plots)
goes into `--out`; the model-level table is printed, or the whole report as JSON with `--json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qtensor.cli.common import (UsageError, add_model_args, check_batch, configs_from_args,
                         demo_config, progress_bar, resolve_device)


def add_parser(sub) -> None:
    p = sub.add_parser("analyze", help="per-layer SQNR, 4over6 choices and scale histograms",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local Hugging Face model directory (default: the built-in model)")
    p.add_argument("--out", default="qtensor-report", metavar="DIR",
                   help="folder for report.md, report.json and the plots (default qtensor-report)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_args(p)
    p.set_defaults(run=run)


def _model_and_run(args, device):
    """(model, run function, name, input shape) for the built-in model or --model DIR."""
    from qtensor.cli.models import build_demo_model, demo_tokens

    if args.model is None:
        cfg = demo_config(args)
        model = build_demo_model(cfg, seed=args.seed, device=device)
        tokens = demo_tokens(cfg, args.batch, args.seq, seed=args.seed, device=device)
        name = f"built-in Llama-style ({cfg.layers} layers, hidden {cfg.hidden})"
        return model, (lambda m: m(tokens)), name, tuple(tokens.shape)
    from qtensor.cli.analyze import load_hf_causal_lm

    try:
        model = load_hf_causal_lm(args.model, seed=args.seed).to(device)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    generator = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
    name = f"{type(model).__name__} from {Path(args.model).name}"
    return model, (lambda m: m(input_ids=tokens, use_cache=False).logits), name, tuple(tokens.shape)


def run(args) -> int:
    from qtensor.cli.analyze import analyze, progress_steps
    from qtensor.cli.report import model_table, write_report

    device = resolve_device(args.device)
    check_batch(args)
    configs = configs_from_args(args)
    if configs is None:
        return 0
    if not args.no_plots:
        import matplotlib  # noqa: F401  (fail before the work, not after it)
    model, run_model, name, shape = _model_and_run(args, device)
    bar = progress_bar(args, progress_steps(model, configs), "analyze")
    try:
        report = analyze(model, run_model, configs, model_name=name, input_shape=shape,
                         skip_incompatible=args.skip_incompatible, progress=bar)
    except ValueError as e:
        raise UsageError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    files = write_report(report, Path(args.out), plots=not args.no_plots)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"qtensor analyze: {name}, input {shape[0]}x{shape[1]} tokens on {device}")
    print(model_table(report))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
