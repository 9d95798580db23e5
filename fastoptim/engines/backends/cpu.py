"""The fused CPU backend: the C kernel of ``fastoptim/kernels/fused_cpu.c``, one call per table
(or per tensor, single-tensor), on torch's threads. Native code holds each table's params and
states and checks them and the grads at every call (``fused_cpu.BoundTable``)."""
import torch

from ...kernels import fused_cpu
from ...multi_tensor import CPU_COLUMN_CHUNK_NUMEL

NAME = "cpu"
DEVICE_TYPES = ("cpu",)
SPLITS_FORMATS = False  # the C kernel reads each tensor's state format from its layout row
CLIPS = True  # it has the clip's kernels, which check the grads themselves: grad_norm_partials, scale_grads
CHECKS_NATIVELY = True  # a call refuses a moved tensor or an unfit grad: Python checks no layout per step
REMAINDERS = True  # it reads and writes bf16 params' master remainders (master_bits 24 and 32)
COLUMN_NUMEL = CPU_COLUMN_CHUNK_NUMEL  # a column-subset chunk: whole rows, which stream best from DRAM
BLOCK_COLUMNS = False  # its walk reads an 8-bit column-subset tensor whole, all its columns in one chunk


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


def bind(spec, tensors, table):
    """Hand the table's params and states to native code (see ``fused_cpu.BoundTable``)."""
    return fused_cpu.BoundTable(spec, tensors, table)


def launch(spec, bound, grads, per_tensor, state_format, values, flags, stochastic):
    """One table's part of a native step call, which ``run_launches`` runs with others. The scalar
    ``values`` (in ``spec.all_scalars`` order: a number, a 0-d tensor or a 1-d tensor with one value
    per tensor) go as numbers, and the tensors among them, in fp32 or float64, replace theirs (no
    host sync). The kernel reads each tensor's state format from its layout row, not from
    ``state_format``."""
    slots = [slot for slot, value in enumerate(values) if isinstance(value, torch.Tensor)]
    if slots:
        numbers = [0.0 if isinstance(value, torch.Tensor) else float(value) for value in values]
        tensors = [values[slot] if values[slot].dtype in (torch.float32, torch.float64) else values[slot].float()
                   for slot in slots]
    else:  # the common case: every scalar a number
        numbers, tensors = list(map(float, values)), []
    return fused_cpu.Launch(bound, grads, numbers, tensors, slots, spec.flag_bits(flags, stochastic), per_tensor)


def run_launches(launches):
    """Run ``launches`` in one native call; False, having changed nothing, when one did not fit."""
    return fused_cpu.step(launches) == fused_cpu.STEPPED


grad_norm_partials = fused_cpu.grad_norm_partials
scale_grads = fused_cpu.scale_grads
TAKEN, PLAN_STALE = fused_cpu.TAKEN, fused_cpu.PLAN_STALE
