"""Builds the fused CPU kernel with the system C compiler. It is a plain shared library, loaded with
ctypes (fastoptim/kernels/fused_cpu.py): no Python or torch C API, so one build serves every torch."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "fastoptim.kernels._fused_cpu",
    sources=["fastoptim/kernels/fused_cpu.c"],
    depends=["fastoptim/kernels/fused_cpu_specs.h"],  # generated from the kernel specs: see fastoptim/kernels/header.py
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd", "-pthread"],
    extra_link_args=["-pthread", "-ldl"],
    optional=True,  # without a compiler the package still installs; the fused engine falls back to foreach
)])
