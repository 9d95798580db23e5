"""The Triton kernels compiled ahead of time for A100 (sm_80) and H100 (sm_90), with no GPU: what
only the compiler sees. Every checked variant compiles, spills nothing, and in fp32 reads and
writes each stream of a full tile with 128-bit accesses. The compiling runs in a subprocess without
the interpreter, which the rest of the tests run the kernels in."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is an optional extra: pip install fastoptim[triton]")

from benchmarks.triton_kernels import DTYPES, checked_variants, variant_name  # noqa: E402
from fastoptim.optimizers import muon_parts  # noqa: E402
from fastoptim.specs import declared_specs  # noqa: E402

VARIANTS = {variant_name(spec, param, state, **flags): (spec, param, state, flags)
            for spec, param, state, flags in checked_variants()}


@pytest.fixture(scope="module")
def reports():
    """(variant, capability): what compile_report read of it."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.triton_kernels", "--json"], capture_output=True, text=True,
                         env=environment, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    return {(line.pop("variant"), line.pop("capability")): line for line in lines}


def streams(spec, flags):
    """(fp32 streams read, streams written) by a dense tile: param, grad and the param-shaped states the
    algorithm keeps with these flags (Adan: 6 and 5; AdamW: 3 to 5 and 2 to 4; Lion: 3 and 2; Muon's
    momentum: 2 and 2, as it writes its param row, the direction, without reading it; Muon's update:
    1 and 1, its bf16 direction read in 64-bit accesses, as many elements a thread as the param's)."""
    states = len(spec.kept({name: flags[name] for name in spec.flags}))
    return 2 + states - (spec is muon_parts.MOMENTUM_SPEC) - (spec.grad is not None), 1 + states  # grad unwritten


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_kernel_compiles_without_spills_and_with_128_bit_accesses(reports, variant, capability):
    spec, param, state, flags = VARIANTS[variant]
    report = reports[variant, capability]
    assert report["reg"] > 0
    # LOCAL counts spilled registers; STACK may hold a call frame of the slow paths of IEEE division
    # and square root (8 to 24 bytes in a few 8-bit variants), which the hot loop does not touch.
    assert report["local"] == report["local_accesses"] == 0, report
    if param == state == "fp32":
        reads, writes = streams(spec, flags)
        assert report["loads_128"] >= reads and report["stores_128"] >= writes, report


def test_every_algorithm_with_a_triton_kernel_is_checked():
    """Each declared kernel spec has its per-element functions in the one Triton kernel, and each is
    compiled here."""
    from fastoptim.kernels import fused_triton

    names = {spec.name for spec, _, _, _ in VARIANTS.values()}
    assert names == set(fused_triton.ALGORITHMS) == {spec.name for spec in declared_specs()}


def test_no_constexpr_tuple_holds_a_record():
    """Triton before 3.9 (what torch 2.11 and 2.12 ship) loses the field names of a record taken from
    a constexpr tuple (``ROLES[i].row`` did not compile there; found on an H100 with Triton 3.6):
    the kernels' constexpr arguments keep records only at the top (``K.seed``, ``STATES.row[i]``)."""
    from fastoptim.kernels import fused_triton

    def records_inside(value):
        if isinstance(value, tuple):
            return any(isinstance(item, tuple) and (hasattr(item, "_fields") or records_inside(item))
                       for item in value)
        return False

    for spec, param, state, flags in VARIANTS.values():
        options = fused_triton._options(spec, DTYPES[param], DTYPES[state], flags["stochastic"], flags["subsets"],
                                        {name: flags[name] for name in spec.flags})
        assert not [name for name, value in options.items() if records_inside(value)], variant_name(
            spec, param, state, **flags)
