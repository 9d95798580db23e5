"""Builds the native layer, ``fastoptim/_C``: the C kernels (``fused_cpu.c``, compiled as C) and their
torch ops on the LibTorch stable ABI (``native.cpp``), one library. It uses no Python C API and only the
stable ABI of torch, so one build serves every torch from ``TORCH_TARGET`` on (it is an abi3 library).

torch must be importable when this runs (its headers are compiled against): install with
``pip install --no-build-isolation``, after torch. Without torch or a compiler the package still
installs, and the fused CPU engine falls back to foreach with a warning."""
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL = "fastoptim/kernels/fused_cpu.c"
# the kernel's headers: its parts (kernels/cpu/) and its view of the kernel specs (fused_cpu_specs.h, generated:
# see fastoptim/kernels/header.py)
HEADERS = sorted(map(str, Path("fastoptim/kernels").rglob("*.h")))
TORCH_TARGET = "0x020a000000000000"  # 2.10, the first torch with the stable ABI's list and library shims
# Link-time optimisation spreads the kernel's code generation (its chunk functions, each cloned for three
# CPU levels) over the cores: 2 min 56 s of one core became 1 min 26 s on two here, and the steps time
# alike (Adan's, 8-bit Adan's and bf16 AdamW's, interleaved).
LTO_JOBS = f"-flto={len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1}"
# -g0: Python's own CFLAGS hold -g, which made the installed library 30 MB of debug info.
KERNEL_FLAGS = ["-O3", "-g0", "-std=gnu11", "-Wall", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd", "-pthread",
                "-flto", "-fPIC"]
NATIVE_FLAGS = ["-O2", "-g0", "-std=c++17", "-Wall", "-flto", f"-DTORCH_TARGET_VERSION={TORCH_TARGET}"]
LINK_FLAGS = ["-pthread", "-ldl", "-g0", LTO_JOBS]


def torch_paths():
    """torch's include and library folders, or None where torch cannot be imported."""
    try:
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError:
        return None
    return include_paths(), library_paths()


class BuildNative(build_ext):
    """Compiles the C kernel with its C flags, then links it into the C++ library."""

    def build_extension(self, ext):
        ext.extra_objects = self.compiler.compile([KERNEL], output_dir=self.build_temp, extra_postargs=KERNEL_FLAGS,
                                                  depends=HEADERS)
        super().build_extension(ext)


paths = torch_paths()
setup(
    cmdclass={"build_ext": BuildNative},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},  # the library is abi3: one wheel for every Python 3.10+
    ext_modules=[] if paths is None else [Extension(
        "fastoptim._C",
        sources=["fastoptim/kernels/native.cpp"],
        depends=[KERNEL, *HEADERS],
        include_dirs=paths[0] + ["fastoptim/kernels"],
        library_dirs=paths[1],
        libraries=["torch_cpu"],
        extra_compile_args=NATIVE_FLAGS,
        extra_link_args=LINK_FLAGS,
        language="c++",
        py_limited_api=True,
        optional=True,  # without a compiler the package still installs; the fused engine falls back to foreach
    )],
)
