"""The fused GPU backend: the Triton kernels of ``fastoptim/kernels/fused_triton.py``, one launch per
table (or per tensor, single-tensor). With ``TRITON_INTERPRET=1`` they run CPU tensors in Triton's
interpreter, which is how the tests check them without a GPU."""
import os

import torch

try:
    from ...kernels import fused_triton
except ModuleNotFoundError as error:  # Triton is an optional extra: pip install fastoptim[triton]
    if error.name != "triton":
        raise
    fused_triton = None

NAME = "triton"
DEVICE_TYPES = ("cuda",)
SPLITS_FORMATS = True  # a kernel is compiled for one state dtype


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


def scalars(values, names, per_tensor, rows, table, device):
    """The kernels' scalars: an fp32 tensor on ``device`` with one row per tensor (``rows``) when one
    of them is per tensor, else one shared row. Tensor values (a tensor lr, the clip coefficient,
    found_inf, the step's bias corrections, the seed of stochastic rounding) never leave the device;
    the plain numbers are sent once and kept with ``table`` while they stay the same. So a step sends
    nothing to the device and waits for nothing: it can be captured in a CUDA graph once warmed up."""
    rows = rows if any(name in per_tensor for name in names) else 1
    numbers = tuple(0.0 if isinstance(values[n], torch.Tensor) else float(values[n]) for n in names)
    if table.numbers is None or table.numbers[0] != numbers:
        table.numbers = numbers, torch.tensor(numbers, device=device)
    return torch.stack([values[n].to(device, torch.float32).expand(rows) if isinstance(values[n], torch.Tensor)
                        else table.numbers[1][i].expand(rows) for i, n in enumerate(names)], dim=1)


def run(part, table, ranges, state_format, values):
    param = part.tensors["param"][0]
    pointers, work = table.device_tables(param.device)
    array = scalars(values, part.spec.all_scalars, part.per_tensor, len(part), table, param.device)
    for first, last in ranges:
        fused_triton.launch(part.spec, pointers, len(part), work[first:last], array, param.dtype, state_format.dtype,
                            stochastic=part.stochastic_rounding, subsets=bool((table.subsets > 1).any()),
                            flags=part.flags)
