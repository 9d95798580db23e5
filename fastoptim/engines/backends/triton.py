"""The fused GPU backend: the Triton kernels of ``fastoptim/kernels/fused_triton.py``, one launch per
table (or per tensor, single-tensor). With ``TRITON_INTERPRET=1`` they run CPU tensors in Triton's
interpreter, which is how the tests check them without a GPU. Where the native library is loaded,
it holds each table's params and states and checks them and the grads before every launch (as it
does for the C kernel, whose tables it runs too), so a step checks no tensor in Python."""
import os
from typing import NamedTuple

import numpy as np
import torch

from ...multi_tensor import CHUNK_NUMEL, PointerTable, bump_versions, data_pointers, sent_to
from ...states import master
from . import cpu

try:
    from ...kernels import fused_triton
except ModuleNotFoundError as error:  # Triton is an optional extra: pip install fastoptim[triton]
    if error.name != "triton":
        raise
    fused_triton = None
# Triton's kernels are made for its interpreter where it is on when they are decorated, at import: set later,
# CPU tensors would reach compiled kernels (Triton's "0 active drivers", helper-102)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

NAME = "triton"
DEVICE_TYPES = ("cuda",)
SPLITS_FORMATS = True  # a kernel is compiled for one state dtype
CLIPS = False  # the clip runs torch's foreach ops on CUDA tensors
STEP_SCALARS = False
CHECKS_NATIVELY = cpu.AVAILABLE  # else the step work and the engine check the tensors in Python
REMAINDERS = True  # it reads and writes bf16 params' master remainders (master_bits 24 and 32)
ROUNDS_SCALED_GRADS = False  # the compiler may fuse grad · grad scale into the momentum's FMAs, unrounded
COLUMN_NUMEL = CHUNK_NUMEL  # a column-subset chunk: one program's share, for the GPU's parallelism
BLOCK_COLUMNS = True  # a program takes a run of whole blocks of columns (a GPU needs the parallelism)


def available():
    return fused_triton is not None


def refusal(param):
    if not available():
        return "Triton is not installed (pip install fastoptim[triton])"
    if param.device.type == "cpu" and not (INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"):
        return "Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1, set before fastoptim is imported)"
    if param.device.type not in ("cpu", "cuda"):
        return f"no Triton kernel for {param.device.type} tensors"
    if param.dtype not in fused_triton.PARAM_TYPES:
        return f"no fused kernel for {param.dtype}"
    return None


def scalars(values, rows, table, device):
    """The kernels' scalars (``values``, in the spec's ``all_scalars`` order: a number, a 0-d tensor or
    a 1-d tensor with one value per tensor): an fp32 tensor on ``device`` with one row per tensor
    (``rows``) when one of them is per tensor, else one shared row. Tensor values (a tensor lr, the
    clip coefficient, found_inf, the step's bias corrections, the seed of stochastic rounding) never
    leave the device; the plain numbers are sent once and kept with ``table`` while they stay the
    same. So a step sends nothing to the device and waits for nothing: it can be captured in a CUDA
    graph once warmed up."""
    tensors = [isinstance(value, torch.Tensor) for value in values]
    numbers = tuple(0.0 if tensor else float(value) for value, tensor in zip(values, tensors))
    if table.numbers is None or table.numbers[0] != numbers:
        table.numbers = numbers, sent_to(np.array(numbers, dtype=np.float32), device)
    if not any(tensors):
        return table.numbers[1][None]
    rows = rows if any(value.dim() == 1 for value, tensor in zip(values, tensors) if tensor) else 1
    return torch.stack([value.to(device, torch.float32).expand(rows) if tensor else table.numbers[1][i].expand(rows)
                        for i, (value, tensor) in enumerate(zip(values, tensors))], dim=1)


class Table(NamedTuple):
    """A table as the launches read it: its pointer table, which is sent to the device, the native
    binding of its tensors (None without the native library), which checks them, its params, and the
    bits of their master remainders (0: none)."""
    pointers: PointerTable
    native: "cpu.BoundTable | None"
    params: list
    remainder_bits: int


class Launch(NamedTuple):
    """One launch of ``spec``'s kernel over a table (once per tensor with ``per_tensor``)."""
    spec: object
    table: Table
    grads: list
    per_tensor: bool
    state_format: object
    values: list  # the scalars, in spec.all_scalars order
    flags: dict
    stochastic: bool


def bind(spec, tensors, table, watched=(), originals=None, rule="", counts=()):
    """The pointer table, and its params, states and block maxima bound to native code (which checks
    the ``watched`` tensors too, and holds the ``originals`` in place of their views). Its launches
    bring every scalar: no ``rule`` computes them, and Python advances the ``counts``."""
    remainders = tensors.get(master.KEY)
    native = cpu.BoundTable(spec, tensors, table, runs=False, watched=watched,
                            originals=originals) if CHECKS_NATIVELY else None
    return Table(table, native,
                 tensors["param"], 0 if remainders is None else remainders[0].element_size() * 8)


def holds(tables):
    """Whether the tensors of ``tables`` (:class:`Table`) are where and as they were bound: their native
    bindings, which check them as the CPU's tables are checked (see ``cpu.holds``), say so."""
    return cpu.holds([table.native for table in tables])


def check(tables, grads):
    """``cpu.check`` of the native bindings of ``tables`` (:class:`Table`), with their ``grads``."""
    return cpu.check([table.native for table in tables], grads)


def launch(spec, bound, grads, per_tensor, state_format, values, flag_bits, options=None):
    return Launch(spec, bound, grads, per_tensor, state_format, values, *spec.unpack_flags(flag_bits))


def run_launches(launches):
    """Check every launch's tables and grads (natively where the library is loaded, all before any
    runs), then launch each and bump its params' version counters (as torch's in-place ops do);
    False, having changed nothing, when a tensor moved or a grad does not fit."""
    grads = [grad for launch in launches for grad in launch.grads]
    if CHECKS_NATIVELY:
        status, pointers = check([launch.table for launch in launches], grads)
        if status != cpu.STEPPED:
            return False
    else:  # the step work and the engine checked the tensors
        pointers = data_pointers(grads)
    first = 0
    for each in launches:
        _run(each, pointers[first:first + len(each.grads)])
        bump_versions(each.table.params)
        first += len(each.grads)
    return True


def _run(launch, grad_pointers):
    table = launch.table.pointers
    table.refresh_grads(grad_pointers)
    n_tensors, device = table.pointers.shape[1], table.device
    pointers, work = table.device_tables(device)
    array = scalars(launch.values, n_tensors, table, device)
    ranges = zip(table.first_chunk[:-1], table.first_chunk[1:]) if launch.per_tensor else [(0, len(table.chunks))]
    for first, last in ranges:
        fused_triton.launch(launch.spec, pointers, n_tensors, work[first:last], array, table.dtype,
                            launch.state_format.dtype, stochastic=launch.stochastic,
                            remainder_bits=launch.table.remainder_bits,
                            subsets=bool((table.subsets > 1).any()), flags=launch.flags)
