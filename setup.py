"""Builds the fused CPU kernel with the system C compiler. It is a plain shared library, loaded with
ctypes (fastoptim/kernels/fused_cpu.py): no Python or torch C API, so one build serves every torch."""
import os

from setuptools import Extension, setup

# Link-time optimisation spreads the one source's code generation (its chunk functions, each cloned for
# three CPU levels) over the cores: 2 min 56 s of one core became 1 min 26 s on two here, and the steps
# time alike (Adan's, 8-bit Adan's and bf16 AdamW's, interleaved).
LTO_JOBS = f"-flto={len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1}"

setup(ext_modules=[Extension(
    "fastoptim.kernels._fused_cpu",
    sources=["fastoptim/kernels/fused_cpu.c"],
    depends=["fastoptim/kernels/fused_cpu_specs.h"],  # generated from the kernel specs: see fastoptim/kernels/header.py
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd",
                        "-pthread", "-flto"],
    extra_link_args=["-pthread", "-ldl", LTO_JOBS],
    optional=True,  # without a compiler the package still installs; the fused engine falls back to foreach
)])
