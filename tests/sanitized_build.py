"""The ASan/UBSan build of the native library (the C kernel and its torch ops) and the run of the
kernel tests on it that tests/test_sanitizers.py checks. The build takes about a minute and the run
two to three more, so the session starts both in the background once it knows the sanitizer tests
will run (tests/conftest.py), while the other tests run: they mostly leave a core free. Python and
torch are not instrumented, so libasan is preloaded (its malloc then serves torch's CPU tensors too: a
freed tensor's memory is poisoned and quarantined) and only our library's accesses are checked;
UBSan reports only in instrumented code anyway."""
import os
import runpy
import shlex
import shutil
import subprocess
import sys
import threading
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


# The tests of the CPU kernel, less: Triton's; the peak-memory ones, since ASan's allocator keeps freed
# memory resident, so a step's peak cannot be read from /proc; the loop and foreach engines' variants,
# which never call the kernel; and the 8-bit training runs (a minute and more under ASan, for kernel
# paths the other tests cover).
DESELECT = ["triton", "allocates_nothing", "foreach_scratch", "loop]", "foreach]", "train_as_well"]
# With the states-moved test, whose cache bug wrote into freed memory: ASan reported it (heap-use-after-free);
# and the torch ops' tests, whose unchecked arguments once made the kernel read and write out of bounds.
OP_TESTS = ["test_the_step_ops_refuse_bad_arguments_by_name_and_change_nothing",
            "test_the_step_op_checks_again_when_the_same_tensors_come_with_other_flags",
            "test_the_step_op_still_steps_what_it_is_given_right",
            "test_the_clip_ops_take_strided_and_expanded_grads_as_torch_does",
            "test_the_clip_ops_refuse_a_factor_they_cannot_read"]
SELECTION = ["tests/test_fused.py", "tests/test_blockwise8.py", "tests/test_clip.py", "tests/test_state_bits.py",
             "tests/test_native_layer.py",  # every change to a bound table's tensors between steps
             "tests/test_adversarial.py::test_states_moved_to_new_storage_in_place_are_seen_by_the_step_cache",
             *(f"tests/test_reliability.py::{name}" for name in OP_TESTS),
             "-k", " and ".join(f"not {name}" for name in DESELECT)]


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


def sanitized(library, *args):
    """``python *args`` with the sanitized ``library`` loaded, started; its stdout and stderr together,
    as text, piped."""
    found = runtimes()
    env = dict({key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")},  # its own run
               LD_PRELOAD=f"{found['libasan.so']} {found['libstdc++.so.6']}",
               ASAN_OPTIONS="detect_leaks=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", FASTOPTIM_NATIVE_LIBRARY=str(library))
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


class Background:
    """The sanitized library built at ``path`` and the kernel tests (``SELECTION``) run on it, in a thread
    that waits for each. Once ``wait()`` returns: ``build`` (the compilers' finished process) and
    ``build_errors``, and ``tests`` (the run's finished process, or None where the build failed) and
    ``output``, or ``timed_out``."""

    def __init__(self, path):
        self.path, self.tests, self.output, self.stopped, self.timed_out = path, None, "", False, False
        self.lock = threading.Lock()  # a run is started, or stopped, not both
        self.build = start(path)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.build_errors = self.build.communicate()[1]
        with self.lock:
            if self.build.returncode != 0 or self.stopped:
                return
            self.tests = sanitized(self.path, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SELECTION)
        self.output = self.tests.communicate()[0]

    # seconds the build and the run may take in all: about 3 minutes on an idle core, 6 beside a busy
    # one; a hang (a deadlock under the sanitizers) then fails the session instead of holding it
    TIMEOUT = 1200

    def wait(self):
        """Wait for the build and the run to finish; past ``TIMEOUT`` seconds, stop them and set
        ``timed_out``."""
        if not self.timed_out:
            self.thread.join(self.TIMEOUT)
            if self.thread.is_alive():
                self.timed_out = True
                self.stop()
                self.thread.join(60)  # a killed shell's compiler may hold its pipe until it ends
        return self

    def stop(self):
        """End the build and the run where they still go (the session stopped before their test)."""
        with self.lock:
            self.stopped = True
            for process in (self.build, self.tests):
                if process is not None and process.poll() is None:
                    process.kill()


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
