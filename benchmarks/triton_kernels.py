"""What the compiler makes of each Triton kernel variant for real GPUs, with no GPU present.

    python -m benchmarks.triton_kernels [--arch 80 90] [--all] [--json]

Compiles ahead of time (``fused_triton.compile_for``) and reports per variant: registers per
thread, spilled bytes (local memory), call-stack bytes, and the 128-bit global loads and stores in
the PTX. By default the variants tests/test_triton_compile.py checks; ``--all`` every combination.
It needs the kernels compiled, not interpreted: run it without ``TRITON_INTERPRET=1``.
"""
import argparse
import itertools
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton

from fastoptim.kernels import fused_triton

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "8-bit": torch.uint8}
PARAMS = ("fp32", "bf16", "fp16")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def variant_name(kernel, param, state, **flags):
    return " ".join([kernel, f"param={param}", f"states={state}", *(name for name, on in flags.items() if on)])


def all_variants():
    """Every variant the engine can launch: (kernel, param dtype, state dtype, flags)."""
    for kernel, param, state in itertools.product(fused_triton.KERNELS, PARAMS, ("fp32", "bf16", "8-bit")):
        extra = [("amsgrad", "first_moment")] if kernel == "adamw" else [()]
        for names in extra:
            for values in itertools.product((False, True), repeat=2 + len(names)):
                stochastic, subsets, *rest = values
                if stochastic and param != "bf16":
                    continue  # rounding by chance only exists for bf16 params
                yield kernel, param, state, dict(stochastic=stochastic, subsets=subsets, **dict(zip(names, rest)))


def checked_variants():
    """A variant per (kernel, param dtype, state dtype) with the subset-norm path (which compiles the
    dense one too), every flag on in some of them, plus the dense-only fp32 ones that reach 128-bit
    accesses most simply."""
    for kernel, (i, (param, state)) in itertools.product(fused_triton.KERNELS, enumerate(
            itertools.product(PARAMS, ("fp32", "bf16", "8-bit")))):
        flags = dict(stochastic=param == "bf16", subsets=True)
        if kernel == "adamw":
            flags |= dict(amsgrad=i % 2 == 0, first_moment=i % 3 != 2)
        yield kernel, param, state, flags
    yield "adan", "fp32", "fp32", dict(stochastic=False, subsets=False)
    yield "adamw", "fp32", "fp32", dict(stochastic=False, subsets=False, amsgrad=False, first_moment=True)


def compile_report(capability, kernel, param, state, flags):
    """Compile one variant for ``capability`` (80, 90) and read what it became."""
    compiled = fused_triton.compile_for(capability, kernel, DTYPES[param], DTYPES[state], **flags)
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    resources = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return resources | dict(loads_128=len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
                            stores_128=len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
                            local_accesses=len(re.findall(r"\b(?:ld|st)\.local", ptx)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--all", action="store_true", help="every variant, not only those the tests check")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = parser.parse_args(argv)
    if not args.json:
        print("| variant | sm | registers | spilled bytes | stack bytes | 128-bit loads | 128-bit stores |")
        print("|---|---|---|---|---|---|---|")
    for kernel, param, state, flags in all_variants() if args.all else checked_variants():
        for capability in args.arch:
            r = compile_report(capability, kernel, param, state, flags)
            name = variant_name(kernel, param, state, **flags)
            if args.json:
                print(json.dumps(dict(variant=name, capability=capability, **r)), flush=True)
            else:
                print(f"| {name} | {capability} | {r['reg']} | {r['local']} | {r['stack']} | {r['loads_128']} | "
                      f"{r['stores_128']} |", flush=True)


if __name__ == "__main__":
    main()
