"""The native library under AddressSanitizer and UndefinedBehaviorSanitizer: it is built with both
and the kernel tests run again on that build, in a subprocess that loads it through
FASTOPTIM_NATIVE_LIBRARY. Python and torch are not instrumented, so libasan is preloaded (its
malloc then serves torch's CPU tensors too: a freed tensor's memory is poisoned and quarantined)
and only our library's accesses are checked; UBSan reports only in instrumented code anyway. A
deliberate use after free shows that the job fails on a bad access.
"""
import os
import subprocess
import sys

import pytest

from .conftest import SANITIZED_BUILD
from .sanitized_build import ROOT, runtimes, start

pytestmark = pytest.mark.sanitizers

# The tests of the CPU kernel (one to three minutes under the sanitizers here), less: Triton's; the
# peak-memory ones, since ASan's allocator keeps freed memory resident, so a step's peak cannot be
# read from /proc; the loop and foreach engines' variants, which never call the kernel; and the
# 8-bit training runs (a minute and more under ASan, for kernel paths the other tests cover).
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
REPORTS = ("ERROR: AddressSanitizer", "runtime error:")
RUNTIMES = runtimes()
if RUNTIMES is None:
    pytest.skip("the sanitizer build needs gcc with its sanitizer runtimes", allow_module_level=True)


@pytest.fixture(scope="module")
def library(request, tmp_path_factory):
    """The sanitized kernel: the build the session started in the background (tests/conftest.py), or
    one started now."""
    build = request.config.stash.get(SANITIZED_BUILD, None)
    if build is None:
        path = tmp_path_factory.mktemp("sanitizers") / "native_sanitized.so"
        build = start(path), path
    process, path = build
    _, errors = process.communicate()
    assert process.returncode == 0, errors[-5000:]
    return path


def sanitized(library, *args):
    """``python *args`` with the sanitized kernel: exit code and output (stdout and stderr)."""
    env = dict(os.environ, LD_PRELOAD=f"{RUNTIMES['libasan.so']} {RUNTIMES['libstdc++.so.6']}",
               ASAN_OPTIONS="detect_leaks=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", FASTOPTIM_NATIVE_LIBRARY=str(library))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    return out.returncode, out.stdout


def test_the_sanitized_build_is_the_one_loaded(library):
    code, output = sanitized(library, "-c", "from fastoptim.engines.backends import cpu as cpu_backend; print(cpu_backend.PATH)")
    assert code == 0 and output.strip().splitlines()[-1] == str(library), output[-5000:]


def test_the_kernel_tests_pass_with_no_sanitizer_report(library):
    code, output = sanitized(library, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SELECTION)
    reports = [line for line in output.splitlines() if any(report in line for report in REPORTS)]
    assert code == 0 and not reports, output[-5000:]


USE_AFTER_FREE = """
import ctypes
import torch
from fastoptim.engines.backends import cpu as cpu_backend

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
address = libc.malloc(400_000)
libc.free(ctypes.c_void_p(address))
freed = torch.frombuffer((ctypes.c_char * 400_000).from_address(address), dtype=torch.float32)  # owns nothing
cpu_backend.scale_grads([freed], torch.tensor(0.5))
"""


def test_a_use_after_free_in_the_kernel_fails_the_job(library):
    """Without this, a build that checks nothing would pass the test above."""
    code, output = sanitized(library, "-c", USE_AFTER_FREE)
    assert code != 0 and "ERROR: AddressSanitizer: heap-use-after-free" in output, output[-5000:]
