"""The C kernel under AddressSanitizer and UndefinedBehaviorSanitizer: fused_cpu.c is built with both
and the kernel tests run again on that build, in a subprocess that loads it through
FASTOPTIM_FUSED_CPU_LIBRARY. Python and torch are not instrumented, so libasan is preloaded (its
malloc then serves torch's CPU tensors too: a freed tensor's memory is poisoned and quarantined)
and only our library's accesses are checked; UBSan reports only in instrumented code anyway. A
deliberate use after free shows that the job fails on a bad access.
"""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sanitizers

ROOT = Path(__file__).parent.parent
# -O1 overrides setup.py's -O3. -fno-var-tracking cuts the build from 3 minutes to 2 here: the
# reports keep their file:line, only a debugger's view of local variables goes. An empty VECTORISED
# builds each chunk function once instead of once per CPU level (2 minutes to 1): the clones differ
# in the instructions the compiler picks, not in the memory the code reads and writes; the F16C
# block functions, chosen at run time, are built and run as always.
SANITIZE = ["-O1", "-g", "-fno-var-tracking", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined", "-DVECTORISED=", "-shared", "-fPIC"]
# The tests of the CPU kernel (one to three minutes under the sanitizers here), less: Triton's; the
# peak-memory ones, since ASan's allocator keeps freed memory resident, so a step's peak cannot be
# read from /proc; the loop and foreach engines' variants, which never call the kernel; and the
# 8-bit training runs (a minute and more under ASan, for kernel paths the other tests cover).
DESELECT = ["triton", "allocates_nothing", "foreach_scratch", "loop]", "foreach]", "train_as_well"]
# With the states-moved test, whose cache bug wrote into freed memory: ASan reported it (heap-use-after-free).
SELECTION = ["tests/test_fused.py", "tests/test_blockwise8.py", "tests/test_clip.py", "tests/test_state_bits.py",
             "tests/test_adversarial.py::test_states_moved_to_new_storage_in_place_are_seen_by_the_step_cache",
             "-k", " and ".join(f"not {name}" for name in DESELECT)]
REPORTS = ("ERROR: AddressSanitizer", "runtime error:")

if shutil.which("gcc") is None:
    pytest.skip("the sanitizer build needs gcc", allow_module_level=True)
RUNTIMES = {name: subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
            for name in ("libasan.so", "libubsan.so")}
if not all(os.path.isabs(path) for path in RUNTIMES.values()):  # gcc echoes a bare name it cannot find
    pytest.skip(f"gcc lacks a sanitizer runtime: {RUNTIMES}", allow_module_level=True)


def setup_flags():
    """setup.py's compile and link flags, read from it so that the two builds cannot drift apart."""
    keywords = {k.arg: k.value for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) for k in node.keywords}
    return ast.literal_eval(keywords["extra_compile_args"]), ast.literal_eval(keywords["extra_link_args"])


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    compile_flags, link_flags = setup_flags()
    path = tmp_path_factory.mktemp("sanitizers") / "fused_cpu_sanitized.so"
    build = subprocess.run(["gcc", *compile_flags, *SANITIZE, str(ROOT / "fastoptim/kernels/fused_cpu.c"),
                            "-o", str(path), *link_flags], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-5000:]
    return path


def sanitized(library, *args):
    """``python *args`` with the sanitized kernel: exit code and output (stdout and stderr)."""
    env = dict(os.environ, LD_PRELOAD=RUNTIMES["libasan.so"], ASAN_OPTIONS="detect_leaks=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", FASTOPTIM_FUSED_CPU_LIBRARY=str(library))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    return out.returncode, out.stdout


def test_the_sanitized_build_is_the_one_loaded(library):
    code, output = sanitized(library, "-c", "from fastoptim.kernels import fused_cpu; print(fused_cpu.LIBRARY._name)")
    assert code == 0 and output.strip().splitlines()[-1] == str(library), output[-5000:]


def test_the_kernel_tests_pass_with_no_sanitizer_report(library):
    code, output = sanitized(library, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SELECTION)
    reports = [line for line in output.splitlines() if any(report in line for report in REPORTS)]
    assert code == 0 and not reports, output[-5000:]


USE_AFTER_FREE = """
import torch
from fastoptim.kernels import fused_cpu
from fastoptim.multi_tensor import PointerTable

grads = [torch.ones(100_000)]
table = PointerTable({"param": grads}, ("param",))  # keeps the grad's pointer, not the grad
del grads
other = torch.zeros(100_000)  # without ASan, the freed memory may now be this tensor's
fused_cpu.scale_grads(table, torch.float32, torch.tensor(0.5), 1)
"""


def test_a_use_after_free_in_the_kernel_fails_the_job(library):
    """Without this, a build that checks nothing would pass the test above."""
    code, output = sanitized(library, "-c", USE_AFTER_FREE)
    assert code != 0 and "ERROR: AddressSanitizer: heap-use-after-free" in output, output[-5000:]
