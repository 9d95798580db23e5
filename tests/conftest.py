"""Without a GPU, Triton's kernels run in its interpreter on CPU tensors (see tests/test_triton.py).
It must be chosen before Triton's kernels are defined, when fastoptim is first imported. On a GPU
machine, ``FASTOPTIM_TEST_DEVICE=cuda`` makes the tensors that tests create without naming a device
CUDA tensors, so that the CPU suites run their steps on the GPU (benchmarks/gpu.sh). A session
that will run the sanitizer tests starts their build, and the kernel tests' run on it, in the
background (see tests/sanitized_build.py). Under pytest-xdist (``make test``: two workers, each
taking whole files) no worker knows at collection whether the sanitizer tests will be its own, so
they come first and start that job themselves: their worker waits on it while the other runs the
rest, one core each. That takes a ``--dist`` that keeps a file's tests in one worker (``loadfile``,
as ``make test`` runs them); under ``load`` or ``worksteal`` two workers may each start the job."""
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from . import sanitized_build

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("FASTOPTIM_TEST_DEVICE"):
    torch.set_default_device(os.environ["FASTOPTIM_TEST_DEVICE"])


# The gate draws the same examples on every run (a landing never waits on a lucky draw); `make explore`
# draws new ones, and a failure found there becomes a test of its own.
settings.register_profile("gate", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("FASTOPTIM_HYPOTHESIS", "gate"))


SANITIZED_BUILD = pytest.StashKey()  # the sanitized kernel's build and test run (sanitized_build.Background)


def _in_a_worker():
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_modifyitems(items):
    """Under pytest-xdist, the sanitizer tests first (see the module's docstring), then the files with
    the most tests, which balance the workers best (the order xdist would choose itself, which ``make
    test`` turns off with ``--no-loadscope-reorder``); each file's tests in their order."""
    if _in_a_worker():
        tests = Counter(item.path for item in items)
        items.sort(key=lambda item: (item.get_closest_marker("sanitizers") is None, -tests[item.path]))


def pytest_collection_finish(session):
    """Start the sanitized kernel's build and its tests' run (minutes on one core) now, if the
    sanitizer tests will run in this process, and not under pytest-xdist (see the module's docstring)."""
    if (not _in_a_worker() and any(item.get_closest_marker("sanitizers") for item in session.items)
            and sanitized_build.runtimes()):
        directory = Path(tempfile.mkdtemp(prefix="fastoptim-sanitizers-"))
        session.config.stash[SANITIZED_BUILD] = sanitized_build.Background(directory / "native_sanitized.so")


def pytest_sessionfinish(session):
    run = session.config.stash.get(SANITIZED_BUILD, None)
    if run is not None:
        run.stop()  # where the session stopped before the sanitizer tests: what still goes ends here
        run.wait()
        shutil.rmtree(run.path.parent, ignore_errors=True)
