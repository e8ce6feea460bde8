"""`qtensor bench`: run the benchmark scripts of benchmarks/ and collect their tables.

Every `benchmarks/bench_*.py` of the source checkout is a standalone script that measures on the
devices it finds and prints its own table (ratios measured side by side). This command finds
them, says first what the machine can measure, runs each in a fresh interpreter (so one
script's CUDA state or crash cannot touch the next), and ends with a summary. Arguments after
`--` go to every script. On a machine without CUDA a GPU-only script stops with a CUDA error;
that is reported in one line as "needs CUDA" (not measured here), not as a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from qtensor.backends.env import child_environment
from qtensor.cli.common import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run the kernel and GEMM benchmarks of benchmarks/",
                       description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="benchmarks folder (default: the checkout's)")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="run only scripts whose name contains NAME (repeatable)")
    p.add_argument("--list", action="store_true", help="list the scripts and exit")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per script")
    p.add_argument("--json", action="store_true", help="print a JSON summary with each output")
    p.add_argument("script_args", nargs="*", metavar="-- ARGS", help="passed to every script")
    p.set_defaults(run=run)


def default_dir() -> Path:
    """benchmarks/ beside the qtensor package: present in a source (or editable) checkout."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def discover(folder: Path, only: list[str] | None) -> list[Path]:
    if not folder.is_dir():
        raise UsageError(
            f"no benchmarks folder at {folder}; the benchmarks ship with the source checkout, "
            "so run from a clone or pass --dir PATH."
        )
    scripts = sorted(folder.glob("bench_*.py"))
    if only:
        scripts = [s for s in scripts if any(o in s.stem for o in only)]
    if not scripts:
        which = f" matching {only}" if only else ""
        raise UsageError(f"no benchmarks/bench_*.py scripts{which} in {folder}; "
                         "check --only, or pass --dir PATH.")
    return scripts


def device_note() -> str:
    """What this machine can measure, said before any number is printed."""
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        cap = torch.cuda.get_device_capability(0)
        return (f"CUDA device(s): {names} (sm_{cap[0]}{cap[1]}); torch {torch.__version__}. "
                "GPU rows are kernel timings on this device.")
    return (f"No CUDA device (torch {torch.__version__}, {os.cpu_count()} CPU cores): only CPU "
            "rows can be measured here -- the quantizers' pure-torch reference and the C++ CPU "
            "kernels where they are built. No GEMM and no GPU kernel is timed (those scripts "
            "need CUDA); run `qtensor bench` on a CUDA machine for those tables.")


def run_script(script: Path, args: list[str], timeout: float, capture: bool) -> dict:
    """Run one script; stdout streams through (or is captured for --json), stderr is kept."""
    env = child_environment()
    root = str(script.resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(script), *args], env=env, timeout=timeout,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.PIPE, text=True)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, _text(e.stdout), _text(e.stderr)
    return {"script": script.name, "returncode": rc, "seconds": time.perf_counter() - start,
            "status": _status(rc, err), "output": out, "stderr": err}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _status(rc: int | None, stderr: str) -> str:
    """ok, timed out, needs CUDA (a GPU-only script on a machine without one), or failed."""
    if rc == 0:
        return "ok"
    if rc is None:
        return "timed out"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if not torch.cuda.is_available() and "cuda" in last.lower():
        return "needs CUDA"
    return f"failed (exit {rc})"


def _print_result(r: dict) -> None:
    """After a script: its stderr when it failed, one line when it only lacked a GPU."""
    if r["status"] == "needs CUDA":
        last = r["stderr"].strip().splitlines()[-1]
        print(f"--- skipped: needs a CUDA device, not measured here ({last})", flush=True)
    elif r["status"] != "ok":
        print(r["stderr"][-4000:], end="", file=sys.stderr, flush=True)
    elif r["stderr"]:
        print(r["stderr"], end="", file=sys.stderr, flush=True)


def run(args) -> int:
    folder = Path(args.dir) if args.dir else default_dir()
    scripts = discover(folder, args.only)
    if args.list:
        print("\n".join(s.name for s in scripts))
        return 0
    note = device_note()
    if not args.json:
        print(f"qtensor bench: {note}\n", flush=True)
    results = []
    for script in scripts:
        if not args.json:
            print(f"=== {script.name} {' '.join(args.script_args)}".rstrip(), flush=True)
        results.append(run_script(script, args.script_args, args.timeout, capture=args.json))
        if not args.json:
            _print_result(results[-1])
    if args.json:
        print(json.dumps({"device": note, "results": results}, indent=2))
    else:
        print("\nsummary:")
        for r in results:
            print(f"  {r['script']:<32} {r['status']:<18} {r['seconds']:8.1f} s")
        print(note)
    # A GPU-only script on a CPU-only machine is expected, not a failure.
    return 1 if any(r["status"] not in ("ok", "needs CUDA") for r in results) else 0
