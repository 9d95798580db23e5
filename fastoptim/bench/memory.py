"""Peak extra memory of one optimizer step, read from /proc in a fresh process.

With ``MALLOC_MMAP_THRESHOLD_=65536`` every large block is its own mapping, so a temporary shows in
the peak even after it is freed; glibc's defaults would let freed blocks hide temporaries. The peak
counter is reset just before the step, and VmHWM − VmRSS after it is what the step added at its peak.
"""
import json
import os
import subprocess
import sys


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_step(step):
    """Bytes ``step()`` adds at its peak, in this process (call from a measuring subprocess)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    return (_status_kib("VmHWM") - _status_kib("VmRSS")) * 1024


def peak_extra_bytes(spec):
    """Run :func:`fastoptim.bench.run.step_in_subprocess` for ``spec`` in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    code = ("import json, sys; from fastoptim.bench.run import step_in_subprocess as f; "
            "print(json.dumps(f(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
