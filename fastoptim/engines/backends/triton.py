"""The fused GPU backend: the Triton kernels of ``fastoptim/kernels/fused_triton.py``, one launch per
table (or per tensor, single-tensor). With ``TRITON_INTERPRET=1`` they run CPU tensors in Triton's
interpreter, which is how the tests check them without a GPU."""
import os

import torch

from ...multi_tensor import data_pointers

try:
    from ...kernels import fused_triton
except ModuleNotFoundError as error:  # Triton is an optional extra: pip install fastoptim[triton]
    if error.name != "triton":
        raise
    fused_triton = None

NAME = "triton"
DEVICE_TYPES = ("cuda",)
SPLITS_FORMATS = True  # a kernel is compiled for one state dtype
CLIPS = False  # the clip runs torch's foreach ops on CUDA tensors
CHECKS_NATIVELY = False  # the optimizer's step work and the engine check the tensors' layouts in Python


def available():
    return fused_triton is not None


def refusal(param):
    if not available():
        return "Triton is not installed (pip install fastoptim[triton])"
    if param.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1)"
    if param.device.type not in ("cpu", "cuda"):
        return f"no Triton kernel for {param.device.type} tensors"
    if param.dtype not in fused_triton.PARAM_TYPES:
        return f"no fused kernel for {param.dtype}"
    return None


def scalars(values, names, rows, table, device):
    """The kernels' scalars (``values``: name to a number, a 0-d tensor or a 1-d tensor with one value
    per tensor): an fp32 tensor on ``device`` with one row per tensor (``rows``) when one of them is
    per tensor, else one shared row. Tensor values (a tensor lr, the clip coefficient, found_inf,
    the step's bias corrections, the seed of stochastic rounding) never leave the device; the plain
    numbers are sent once and kept with ``table`` while they stay the same. So a step sends nothing
    to the device and waits for nothing: it can be captured in a CUDA graph once warmed up."""
    per_tensor = any(isinstance(values[n], torch.Tensor) and values[n].dim() == 1 for n in names)
    rows = rows if per_tensor else 1
    numbers = tuple(0.0 if isinstance(values[n], torch.Tensor) else float(values[n]) for n in names)
    if table.numbers is None or table.numbers[0] != numbers:
        table.numbers = numbers, torch.tensor(numbers, device=device)
    return torch.stack([values[n].to(device, torch.float32).expand(rows) if isinstance(values[n], torch.Tensor)
                        else table.numbers[1][i].expand(rows) for i, n in enumerate(names)], dim=1)


def bind(spec, tensors, table):
    """What a launch reads: the pointer table itself (its grads' row is refreshed at each launch)."""
    return table


def run(spec, table, grads, per_tensor, state_format, values, flags, stochastic):
    table.refresh_grads(data_pointers(grads))
    n_tensors, device = table.pointers.shape[1], table.device
    pointers, work = table.device_tables(device)
    array = scalars(values, spec.all_scalars, n_tensors, table, device)
    ranges = zip(table.first_chunk[:-1], table.first_chunk[1:]) if per_tensor else [(0, len(table.chunks))]
    for first, last in ranges:
        fused_triton.launch(spec, pointers, n_tensors, work[first:last], array, table.dtype, state_format.dtype,
                            stochastic=stochastic, subsets=bool((table.subsets > 1).any()), flags=flags)
    return True
