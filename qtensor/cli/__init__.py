"""The command line: `python -m qtensor {demo,analyze,bench,study}` (also the `qtensor` script).

[Note: command-line errors]
A user on a common path (no CUDA when asking for it, a layer shape a format cannot take, a
missing optional package, a bad option value) gets one sentence with the remedy on stderr and
exit code 2, never a traceback. Commands raise `UsageError` for those; `main` prints it. Any
other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from qtensor.cli import analyze_cmd, bench, demo, study
from qtensor.cli.common import OPTIONAL_PACKAGES, UsageError, quiet_loggers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qtensor", description="NVFP4 / MXFP8 quantized tensors: demo, numerics, benchmarks."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, analyze_cmd, bench, study):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    try:
        with quiet_loggers("torch.utils._pytree"):
            if args.command != "bench":  # bench runs scripts in subprocesses: no torchao here
                with quiet_loggers("torchao"):
                    import qtensor.quantize  # noqa: F401
            return int(args.run(args) or 0)
    except UsageError as e:
        return _fail(args.command, str(e))
    except ModuleNotFoundError as e:
        if e.name not in OPTIONAL_PACKAGES:
            raise
        return _fail(args.command, f"this needs the optional package {e.name!r}, which is not "
                     f"installed; {OPTIONAL_PACKAGES[e.name]}.")
    except KeyboardInterrupt:
        return _fail(args.command, "interrupted.", code=130)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit's flush does not raise again
        return 141


def _fail(command: str, message: str, code: int = 2) -> int:
    print(f"qtensor {command}: error: {message}", file=sys.stderr)
    return code


__all__ = ["UsageError", "main"]
