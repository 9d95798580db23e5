"""Peak extra memory of one optimizer step, read from /proc in a fresh process.

With ``MALLOC_MMAP_THRESHOLD_=65536`` every large block is its own mapping, so a temporary shows in
the peak even after it is freed; glibc's defaults would let freed blocks hide temporaries. The peak
counter is reset just before the step, and VmHWM − VmRSS after it is what the step added at its peak.
"""
import json
import os
import subprocess
import sys
import tempfile


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


def in_subprocess(target, spec):
    """``target(spec)`` ("module:function", ``spec`` and its result JSON) in a fresh process set up
    for measuring. A process that fails raises RuntimeError with the end of what it printed."""
    (result,) = streamed(target, spec)
    return result


def streamed(target, spec):
    """Like in_subprocess, for a ``target`` that is a generator: its items, as each comes."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    module, function = target.split(":")
    code = (f"import json, sys, types; from {module} import {function} as f\n"
            "result = f(json.loads(sys.argv[1]))\n"
            "for item in result if isinstance(result, types.GeneratorType) else [result]:\n"
            "    print('item', json.dumps(item), flush=True)")
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                              stderr=errors, text=True) as process:
            for line in process.stdout:
                if line.startswith("item "):  # anything else is what an import printed
                    yield json.loads(line[5:])
        if process.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"measuring process failed ({process.returncode}): {errors.read().strip()[-500:]}")
