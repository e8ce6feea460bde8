"""Build of qtensor: the Python package, plus the C++/CUDA extension `qtensor._C` from csrc/.

This is the only place that decides what gets compiled:
- the CPU kernels (csrc/*.cpp) wherever a C++ compiler exists;
- the CUDA kernels (csrc/*.cu) where torch was built with CUDA and nvcc is found.
Without a compiler the package installs pure Python and every op runs the reference.

Settings (read once, here): QTENSOR_NO_EXTENSION=1 skips the extension; QTENSOR_CUDA_ARCHS
(e.g. "90a" or "90a;100a") overrides the CUDA targets; MAX_JOBS sets ninja's parallelism.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
# No -ffast-math, no FMA contraction: the kernels must round exactly like the reference.
CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]
# at::parallel_for is a header template that runs serially unless the extension itself is built
# with OpenMP (ATen/ParallelOpenMP.h tests _OPENMP): without it the CPU kernels used one core.
# torch's Linux builds use OpenMP (libgomp); elsewhere the kernels stay single-threaded.
OPENMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []
NVCC_FLAGS = ["-O3", "-std=c++17", "--fmad=false", "--expt-relaxed-constexpr", "-lineinfo"]


def _have_cxx() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _nvcc_version(cuda_home: str | None) -> tuple[int, int] | None:
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cuda_gencode(version: tuple[int, int]) -> list[str]:
    """sm_90a (H100/H200), sm_100a when nvcc knows it, and compute_80 PTX as the portable target."""
    archs = os.environ.get("QTENSOR_CUDA_ARCHS")
    if archs:
        names = [a.strip() for a in archs.split(";") if a.strip()]
    else:
        names = ["90a"] + (["100a"] if version >= (12, 8) else []) + ["80+PTX"]
    flags = []
    for name in names:
        ptx = name.endswith("+PTX")
        num = name.removesuffix("+PTX")
        code = f"compute_{num}" if ptx else f"sm_{num}"
        flags.append(f"-gencode=arch=compute_{num},code={code}")
    return flags


def _extensions():
    if os.environ.get("QTENSOR_NO_EXTENSION") == "1" or not _have_cxx():
        return [], {}
    import torch
    from torch.utils import cpp_extension

    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    if not sources:
        return [], {}
    cuda_sources = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    version = _nvcc_version(cpp_extension.CUDA_HOME) if torch.version.cuda else None
    kwargs = dict(name="qtensor._C", include_dirs=[os.path.join(ROOT, CSRC)])
    if cuda_sources and version is not None:
        ext = cpp_extension.CUDAExtension(
            sources=sources + cuda_sources,
            extra_compile_args={
                "cxx": CXX_FLAGS + OPENMP_FLAGS + ["-DQTENSOR_WITH_CUDA"],
                "nvcc": NVCC_FLAGS + _cuda_gencode(version),
            },
            extra_link_args=OPENMP_FLAGS,
            **kwargs,
        )
    else:
        ext = cpp_extension.CppExtension(
            sources=sources, extra_compile_args=CXX_FLAGS + OPENMP_FLAGS, extra_link_args=OPENMP_FLAGS, **kwargs
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
