"""Registers, spills and shared memory of every kernel of a CUDA source, as ptxas reports them for
one target, in one tree or two side by side: a kernel's register budget shows before any GPU run.

A kernel's `__launch_bounds__` minimum of CTAs an SM caps its registers (4 CTAs of 256 threads:
64), and a template argument that moves a kernel to another cap moves its occupancy without any
test failing. Compiling the source here, without a GPU, lists what ptxas gave each kernel:

    python3 dev/ptxas_regs.py TREE                 # every kernel of TREE's csrc/quant_cuda.cu
    python3 dev/ptxas_regs.py BASE TREE            # the kernels whose figures differ, and those
                                                   # in one tree only
    python3 dev/ptxas_regs.py --source csrc/decode_gemm_cuda.cu --arch 90a BASE TREE

It runs nvcc with setup.py's own nvcc flags (read from its NVCC_FLAGS) and `-Xptxas -v` for one
target (default sm_90a), against the include folders of the torch that runs it. A CPU build of
torch ships the CUDA headers but one generated header, c10/cuda/impl/cuda_cmake_macros.h; a
stand-in is written to a temporary folder where it is missing. Kernels are named demangled (by
c++filt) without their parameter lists, and matched between trees by those names; a kernel whose
template parameters changed is listed as in one tree only. One compile of quant_cuda.cu takes
about a minute and a half on two cores.

Settings (read once, here): NVCC, the compiler (default: nvcc on PATH).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

NVCC = os.environ.get("NVCC", "nvcc")


@dataclass(frozen=True)
class Kernel:
    registers: int
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0  # static shared memory, bytes


def parse_ptxas(text: str) -> dict[str, Kernel]:
    """Entry functions of a `ptxas -v` report (mangled names) -> their figures."""
    regs: dict[str, tuple[int, int]] = {}
    spills: dict[str, tuple[int, int]] = {}
    entry = props = None
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            entry = m.group(1)
        elif m := re.search(r"Function properties for (\S+)", line):
            props = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            if props is not None:
                spills[props] = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and entry is not None:
            smem = re.search(r"(\d+) bytes smem", line)
            regs[entry] = (int(m.group(1)), int(smem.group(1)) if smem else 0)
            entry = None
    return {name: Kernel(r, *spills.get(name, (0, 0)), s) for name, (r, s) in regs.items()}


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable names without parameter lists, by c++filt: the mangled names of one
    kernel differ between trees (an anonymous namespace's name holds a hash of its file)."""
    tool = shutil.which("c++filt")
    if tool is None:
        raise SystemExit("ptxas_regs: no c++filt on PATH to name the kernels; install binutils (it comes with gcc).")
    if not names:
        return {}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    short = []
    for line in out.splitlines():
        line = line.replace("(anonymous namespace)::", "").removeprefix("void ")
        depth = 0
        for i, ch in enumerate(line):  # cut at the parameter list: the first '(' outside <...>
            depth += ch == "<"
            depth -= ch == ">"
            if ch == "(" and depth == 0:
                line = line[:i]
                break
        short.append(line)
    return dict(zip(names, short))


def setup_nvcc_flags(tree: str) -> list[str]:
    """NVCC_FLAGS as setup.py assigns them (a list of string literals)."""
    path = os.path.join(tree, "setup.py")
    with open(path) as f:
        module = ast.parse(f.read(), path)
    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NVCC_FLAGS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit(f"ptxas_regs: {path} assigns no NVCC_FLAGS list; pass a tree with qtensor's setup.py.")


def include_dirs(stub_root: str) -> list[str]:
    from torch.utils import cpp_extension

    dirs = list(cpp_extension.include_paths())
    if not any(os.path.exists(os.path.join(d, "c10/cuda/impl/cuda_cmake_macros.h")) for d in dirs):
        stub = os.path.join(stub_root, "c10/cuda/impl")
        os.makedirs(stub, exist_ok=True)
        with open(os.path.join(stub, "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        dirs.insert(0, stub_root)
    return dirs + [sysconfig.get_paths()["include"]]


def compile_report(tree: str, source: str, arch: str) -> str:
    """ptxas's report for `source` of `tree` (nvcc's whole output; raises with it on failure)."""
    if shutil.which(NVCC) is None:
        raise SystemExit(f"ptxas_regs: no {NVCC} on PATH; set NVCC to the CUDA compiler.")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, *setup_nvcc_flags(tree), f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
               "-DTORCH_EXTENSION_NAME=_C", "-I", os.path.join(tree, "csrc")]
        for d in include_dirs(tmp):
            cmd += ["-I", d]
        cmd += ["-c", os.path.join(tree, source), "-o", os.path.join(tmp, "out.o")]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"ptxas_regs: nvcc failed on {tree}/{source}:\n{run.stdout}{run.stderr}")
        return run.stdout + run.stderr


def cells(k: Kernel | None) -> list[str]:
    """Registers, spills (stores/loads, bytes) and static shared memory; blanks for no kernel."""
    if k is None:
        return ["", "", ""]
    spill = f"{k.spill_stores}/{k.spill_loads}" if k.spill_stores or k.spill_loads else "0"
    return [str(k.registers), spill, str(k.smem)]


def table(reports: list[dict[str, Kernel]], names: list[str], show_all: bool) -> list[str]:
    """Markdown rows: every kernel of one report; of two, those whose figures differ, matched by
    their readable names (demangle)."""
    named = []
    for r in reports:
        readable = demangle(sorted(r))
        named.append({readable[m]: k for m, k in r.items()})
    if len(reports) == 1:
        head = ["| kernel | registers | spills (stores/loads, bytes) | smem |", "|---|---|---|---|"]
    else:
        head = [f"| kernel | registers | spills | smem ({names[0]}) | registers | spills | smem ({names[1]}) |",
                "|---|---|---|---|---|---|---|"]
    rows = []
    for name in sorted(set().union(*named)):
        got = [r.get(name) for r in named]
        if len(got) == 2 and got[0] == got[1] and not show_all:
            continue
        rows.append("| " + " | ".join([name, *(c for k in got for c in cells(k))]) + " |")
    return head + (rows or ["| (no kernel differs) |" + " |" * (3 * len(reports))])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", metavar="TREE", help="one tree, or the base and the tree compared")
    p.add_argument("--source", default="csrc/quant_cuda.cu", help="the CUDA source, relative to each tree")
    p.add_argument("--arch", default="90a", help="the target (sm_ARCH; default 90a)")
    p.add_argument("--all", action="store_true", help="with two trees, list the kernels that did not change too")
    args = p.parse_args(argv)
    if len(args.trees) > 2:
        p.error(f"takes one tree or two (a base and the tree compared); got {len(args.trees)}")
    for t in args.trees:
        if not os.path.isfile(os.path.join(t, args.source)):
            p.error(f"{t} has no {args.source}; pass qtensor checkouts (or --source)")
    reports = [parse_ptxas(compile_report(t, args.source, args.arch)) for t in args.trees]
    print(f"# ptxas, sm_{args.arch}, {args.source}")
    print("\n".join(table(reports, args.trees, args.all)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
