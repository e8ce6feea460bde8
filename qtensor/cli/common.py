"""What the command-line commands share: option helpers, the device, and `UsageError`
([Note: command-line errors] in qtensor/cli/__init__.py)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import torch

# Optional packages and what installs them; a ModuleNotFoundError for one becomes a remedy.
OPTIONAL_PACKAGES = {
    "matplotlib": "pip install matplotlib (or pass --no-plots)",
    "tqdm": "pip install tqdm (or pass --no-progress)",
    "transformers": "pip install 'qtensor[hf]' (or pip install transformers)",
}


class UsageError(Exception):
    """A mistake or a missing piece on the user's side, with its remedy: exit code 2."""


def resolve_device(name: str) -> torch.device:
    """The torch.device for --device, checked before any work starts."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(
            f"--device must be a torch device such as cpu or cuda; got {name!r}.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device {name} asks for CUDA, but this torch ({torch.__version__}) sees no CUDA "
            "device; rerun with --device cpu, or on a machine with a GPU and a CUDA build of torch."
        )
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device takes cpu or cuda; got {name!r}.")
    return device


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Sizes of the built-in Llama-style model and of the input batch (demo and analyze)."""
    from qtensor.cli.models import DemoConfig

    d = DemoConfig()
    g = p.add_argument_group("built-in model")
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--hidden", type=int, default=d.hidden)
    g.add_argument("--intermediate", type=int, default=d.intermediate)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--kv-heads", type=int, default=d.kv_heads)
    g.add_argument("--vocab", type=int, default=d.vocab_size)
    g.add_argument("--tie-embeddings", action="store_true", help="share embedding and LM head")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--configs", default=None,
                   help="comma-separated config names (default: all; `--configs list` shows them)")
    p.add_argument("--skip-incompatible", action="store_true",
                   help="leave layers whose shape a format cannot take in high precision")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def demo_config(args):
    from qtensor.cli.models import DemoConfig

    try:
        return DemoConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                          heads=args.heads, kv_heads=args.kv_heads,
                          intermediate=args.intermediate, tie_embeddings=args.tie_embeddings)
    except ValueError as e:
        raise UsageError(str(e)) from None


def configs_from_args(args):
    """The NamedConfigs of --configs; `list` prints the names and descriptions instead."""
    from qtensor.cli.analyze import builtin_configs, select_configs

    if args.configs == "list":
        for c in builtin_configs():
            print(f"{c.name:18s} {c.description}")
        return None
    names = None if args.configs is None else [n.strip() for n in args.configs.split(",")]
    try:
        return select_configs(names)
    except ValueError as e:
        raise UsageError(f"--configs: {e}") from None


def check_batch(args) -> None:
    if args.batch < 1 or args.seq < 1:
        raise UsageError(f"--batch and --seq must be positive; got {args.batch} and {args.seq}.")


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """Raise the given loggers to ERROR for the duration of the block.

    Importing torchao logs a warning for each of its prebuilt .so files it cannot load (CUDA or
    another Python's builds: two lines on a CPU-only machine), and torch logs a deprecation line
    for each Enum that torchao (or transformers through it) registers with pytree. None of these
    concerns qtensor, and they would bury the command's output.
    """
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def progress_bar(args, total: int, desc: str):
    """A tqdm bar on stderr, or None with --no-progress. disable=None: drawn on a terminal,
    silent when stderr is a file or a pipe (CI logs)."""
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=None)
