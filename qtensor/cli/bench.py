"""`qtensor bench`: run the benchmark scripts of benchmarks/ and collect their tables.

Every `benchmarks/bench_*.py` of the source checkout is a standalone script that measures on the
devices it finds and prints its own table (ratios measured side by side). This command finds
them, says first what the machine can measure, runs each in a fresh interpreter (so one
script's CUDA state or crash cannot touch the next), and ends with a summary. Arguments after
`--` go to every script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from qtensor.cli import UsageError


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
            "rows can be measured here -- the pure-torch reference and emulated GEMMs, and the "
            "C++ CPU kernels where they are built. No GPU kernel is timed; run `qtensor bench` "
            "on a CUDA machine for those tables.")


def run_script(script: Path, args: list[str], timeout: float, capture: bool) -> dict:
    env = dict(os.environ)
    root = str(script.resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(script), *args], env=env, timeout=timeout,
                              capture_output=capture, text=True)
        rc, out = done.returncode, (done.stdout + done.stderr if capture else None)
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.stdout or "") if capture else None
    return {"script": script.name, "returncode": rc, "seconds": time.perf_counter() - start,
            "output": out}


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
    failed = [r for r in results if r["returncode"] != 0]
    if args.json:
        print(json.dumps({"device": note, "results": results}, indent=2))
    else:
        print("\nsummary:")
        for r in results:
            status = "timed out" if r["returncode"] is None else f"exit {r['returncode']}"
            print(f"  {r['script']:<32} {status:<10} {r['seconds']:8.1f} s")
        print(note)
    return 1 if failed else 0
