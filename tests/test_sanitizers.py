"""The native library under AddressSanitizer and UndefinedBehaviorSanitizer: it is built with both
and the kernel tests run again on that build (tests/sanitized_build.py: the session starts both in
the background), in a subprocess that loads it through FASTOPTIM_NATIVE_LIBRARY. A deliberate use
after free shows that the job fails on a bad access.
"""
import pytest

from .conftest import SANITIZED_BUILD
from .sanitized_build import Background, runtimes, sanitized

pytestmark = pytest.mark.sanitizers

REPORTS = ("ERROR: AddressSanitizer", "runtime error:")
if runtimes() is None:
    pytest.skip("the sanitizer build needs gcc with its sanitizer runtimes", allow_module_level=True)


@pytest.fixture(scope="module")
def background(request, tmp_path_factory):
    """The sanitized kernel's build and the kernel tests' run on it, finished: those the session started
    in the background (tests/conftest.py), or started now."""
    run = request.config.stash.get(SANITIZED_BUILD, None)
    if run is None:  # stashed: a session that stops while it goes ends it (tests/conftest.py)
        run = request.config.stash[SANITIZED_BUILD] = Background(tmp_path_factory.mktemp("sanitizers")
                                                                 / "native_sanitized.so")
    run.wait()
    assert not run.timed_out, f"the sanitized build and its kernel tests took over {run.TIMEOUT} s: stopped"
    assert run.build.returncode == 0, run.build_errors[-5000:]
    return run


@pytest.fixture(scope="module")
def library(background):
    return background.path


def test_the_sanitized_build_is_the_one_loaded(library):
    run = sanitized(library, "-c", "from fastoptim.engines.backends import cpu as cpu_backend; print(cpu_backend.PATH)")
    output = run.communicate()[0]
    assert run.returncode == 0 and output.strip().splitlines()[-1] == str(library), output[-5000:]


def test_the_kernel_tests_pass_with_no_sanitizer_report(background):
    output = background.output
    reports = [line for line in output.splitlines() if any(report in line for report in REPORTS)]
    assert background.tests.returncode == 0 and not reports, output[-5000:]


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
    run = sanitized(library, "-c", USE_AFTER_FREE)
    output = run.communicate()[0]
    assert run.returncode != 0 and "ERROR: AddressSanitizer: heap-use-after-free" in output, output[-5000:]
