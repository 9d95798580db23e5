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
from fastoptim.optimizers import adamw, adan
from fastoptim.specs import declared_specs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "8-bit": torch.uint8}
PARAMS = ("fp32", "bf16", "fp16")
# a kernel per spec (AdamW's serves AdamWSN and RMSPropSN; Muon's momentum is the elementwise half of its step)
SPECS = declared_specs()  # every kernel spec the optimizers declare
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def variant_name(spec, param, state, **flags):
    return " ".join([spec.name, f"param={param}", f"states={state}", *(name for name, on in flags.items() if on)])


def all_variants():
    """Every variant the engine can launch: (spec, param dtype, state dtype, flags)."""
    for spec, param, state in itertools.product(SPECS, PARAMS, ("fp32", "bf16", "8-bit")):
        for stochastic, subsets, *values in itertools.product((False, True), repeat=2 + len(spec.flags)):
            if stochastic and param != "bf16":
                continue  # rounding by chance only exists for bf16 params
            if subsets and not spec.reduced:
                continue  # no second moment to keep per subset
            yield spec, param, state, dict(stochastic=stochastic, subsets=subsets, **dict(zip(spec.flags, values)))


def checked_variants():
    """A variant per (spec, param dtype, state dtype) with the subset-norm path where the algorithm
    has one (which compiles the dense one too), every flag on in some of them, plus the dense-only
    fp32 ones that reach 128-bit accesses most simply."""
    for spec, (i, (param, state)) in itertools.product(SPECS, enumerate(
            itertools.product(PARAMS, ("fp32", "bf16", "8-bit")))):
        # each of the spec's flags on in some variants and off in others (the k-th flag: bit k of i)
        flags = dict(stochastic=param == "bf16", subsets=bool(spec.reduced)) | {
            flag: (i >> k) % 2 == 0 for k, flag in enumerate(spec.flags)}
        yield spec, param, state, flags
    yield adan.SPEC, "fp32", "fp32", dict(stochastic=False, subsets=False)
    # bf16 params beside master remainders (master_bits 32: 16 bits; 24: 8 bits)
    yield adan.SPEC, "bf16", "fp32", dict(stochastic=False, subsets=True, remainder16=True)
    yield adamw.SPEC, "bf16", "8-bit", dict(stochastic=False, subsets=True, remainder8=True, amsgrad=True,
                                            first_moment=True)
    yield adamw.SPEC, "fp32", "fp32", dict(stochastic=False, subsets=False, amsgrad=False, first_moment=True)


def compile_report(capability, spec, param, state, flags):
    """Compile one variant for ``capability`` (80, 90) and read what it became."""
    stochastic, subsets = flags["stochastic"], flags["subsets"]
    remainder_bits = 16 if flags.get("remainder16") else 8 if flags.get("remainder8") else 0
    compiled = fused_triton.compile_for(capability, spec, DTYPES[param], DTYPES[state], stochastic=stochastic,
                                        subsets=subsets, flags={name: flags[name] for name in spec.flags},
                                        remainder_bits=remainder_bits)
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
    for spec, param, state, flags in all_variants() if args.all else checked_variants():
        for capability in args.arch:
            r = compile_report(capability, spec, param, state, flags)
            name = variant_name(spec, param, state, **flags)
            if args.json:
                print(json.dumps(dict(variant=name, capability=capability, **r)), flush=True)
            else:
                print(f"| {name} | {capability} | {r['reg']} | {r['local']} | {r['stack']} | {r['loads_128']} | "
                      f"{r['stores_128']} |", flush=True)


if __name__ == "__main__":
    main()
