"""The ASan/UBSan build of the native library (the C kernel and its torch ops) that
tests/test_sanitizers.py runs the kernel tests on. It
takes about a minute (setup.py's link-time optimisation spreads it over the cores), so the session
starts it in the background once it knows the sanitizer tests will run (tests/conftest.py), while
the other tests run: they mostly leave a core free."""
import os
import runpy
import shlex
import shutil
import subprocess
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).parent.parent
# -O1 overrides setup.py's -O3. -fno-var-tracking cuts the build from 3 minutes to 2 here: the
# reports keep their file:line, only a debugger's view of local variables goes. An empty VECTORISED
# builds each chunk function once instead of once per CPU level (2 minutes to 1): the clones differ
# in the instructions the compiler picks, not in the memory the code reads and writes; the F16C
# block functions, chosen at run time, are built and run as always.
SANITIZE = ["-O1", "-g", "-fno-var-tracking", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined", "-DVECTORISED=", "-shared", "-fPIC"]


def runtimes():
    """gcc's sanitizer runtimes, and the C++ runtime, by name; None without gcc, or a name gcc cannot
    find (a bare one). Preloaded after libasan, libstdc++ gives its interceptor the real
    ``__cxa_throw``: without it, the first C++ exception (torch's, for an error raised inside an op)
    aborts the process."""
    if shutil.which("gcc") is None:
        return None
    found = {name: subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
             for name in ("libasan.so", "libubsan.so", "libstdc++.so.6")}
    return found if all(os.path.isabs(path) for path in found.values()) else None


def setup_flags():
    """setup.py's flags (its module globals), read from it so that the two builds cannot drift apart."""
    with mock.patch("setuptools.setup"):
        return runpy.run_path(str(ROOT / "setup.py"))


def start(path):
    """Start building the sanitized native library at ``path``: a shell that compiles the C kernel,
    then compiles and links the torch ops with it; its output is piped."""
    flags = setup_flags()
    includes, libraries = flags["torch_paths"]()
    kernel = shlex.join(["gcc", "-c", *flags["KERNEL_FLAGS"], *SANITIZE, str(ROOT / flags["KERNEL"]),
                         "-o", f"{path}.kernel.o"])
    native = shlex.join(["g++", *flags["NATIVE_FLAGS"], *SANITIZE, *(f"-I{d}" for d in includes),
                         f"-I{ROOT / 'fastoptim/kernels'}", str(ROOT / "fastoptim/kernels/native.cpp"),
                         f"{path}.kernel.o", *(f"-L{d}" for d in libraries), "-ltorch_cpu", "-o", str(path),
                         *flags["LINK_FLAGS"]])
    return subprocess.Popen(["bash", "-c", f"{kernel} && {native}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
