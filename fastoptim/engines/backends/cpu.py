"""The fused CPU backend: the C kernel of ``fastoptim/kernels/fused_cpu.c``, one call per table
(or per tensor, single-tensor), on torch's threads."""
import torch

from ...kernels import fused_cpu

NAME = "cpu"
DEVICE_TYPES = ("cpu",)
SPLITS_FORMATS = False  # the C kernel reads each tensor's state format from its layout row


def available():
    return fused_cpu.AVAILABLE


def refusal(param):
    if not available():
        return "the fused CPU kernel is not built (see the README's set-up)"
    if param.device.type != "cpu":
        return f"no fused kernel for {param.device.type} tensors yet"
    if param.dtype not in fused_cpu.DTYPES:
        return f"no fused kernel for {param.dtype}"
    return None


def scalars(values, names):
    """The C kernel's scalars (``values``: name to a number, a 0-d tensor or a 1-d tensor with one
    value per tensor) as a ctypes array of (pointer, stride), in ``names`` order, and the tensors it
    points into."""
    numbers = torch.tensor([0.0 if isinstance(values[n], torch.Tensor) else float(values[n]) for n in names])
    keep, array = [numbers], (fused_cpu.Scalar * len(names))()
    for i, name in enumerate(names):
        value = values[name]
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float32).contiguous()
            keep.append(value)
            array[i] = fused_cpu.Scalar(value.data_ptr(), int(value.dim() == 1))
        else:
            array[i] = fused_cpu.Scalar(numbers.data_ptr() + 4 * i, 0)
    return array, keep


def run(spec, table, ranges, state_format, values, flags, stochastic):
    array, _keep = scalars(values, spec.all_scalars)
    bits = spec.flag_bits(flags, stochastic)
    n_tensors, dtype = table.pointers.shape[1], table.dtype
    for chunk_range in ranges:
        fused_cpu.run(spec, table.pointers, n_tensors, table.chunks, chunk_range, table.layouts, array, dtype, bits,
                      torch.get_num_threads())
