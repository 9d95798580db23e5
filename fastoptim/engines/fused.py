"""The fused engines (``fused=True``): the C kernel of ``fastoptim/kernels/fused_cpu.c`` for CPU
tensors, the Triton kernels of ``fastoptim/kernels/fused_triton.py`` for CUDA ones
(``FASTOPTIM_FUSED_BACKEND=cpu|triton`` forces one; Triton takes CPU tensors in its interpreter,
``TRITON_INTERPRET=1``, which is how the tests run it without a GPU).

Multi-tensor (``foreach=True``, the default with ``fused=True``): one call per bucket updates every
tensor, parallel over fixed-size chunks across all of them. Single-tensor (``foreach=False``): one
call (or launch) per tensor, as the seeds' FusedAdan does. Both read the pointer table and chunk plan
cached in ``plan.cache``; only the gradients' row is refreshed each step (and sent to the device only
when a grad moved).

States may be fp32, bf16 or 8-bit (``state_bits``): the C kernel dequantizes, updates and
requantizes each 256-element block in one pass, and so do the Triton kernels.

Tensors the kernel cannot take run on the foreach engine instead, with one warning when fused was
asked for: no build (or no Triton), a dtype other than fp32/bf16/fp16, a device the backend does not
run on, a layout where param, grad and states are not dense with the same strides, or 8-bit states
of a param that is not contiguous (the codes are in row-major order).
"""
import operator
import os
import warnings

import torch

from ..kernels import fused_cpu
from ..multi_tensor import PointerTable, data_pointers, is_dense
from ..states import blockwise8
from . import foreach

try:
    from ..kernels import fused_triton
except ModuleNotFoundError as error:  # Triton is an optional extra: pip install fastoptim[triton]
    if error.name != "triton":
        raise
    fused_triton = None

BACKENDS = ("cpu", "triton")


def forced_backend():
    """The kernel family ``FASTOPTIM_FUSED_BACKEND`` forces, or None."""
    forced = os.environ.get("FASTOPTIM_FUSED_BACKEND") or None
    if forced not in (None, *BACKENDS):
        raise ValueError(f"FASTOPTIM_FUSED_BACKEND={forced!r}: expected one of {BACKENDS}")
    return forced


def backend(device):
    """The kernel family for tensors on ``device``: Triton on CUDA, C elsewhere, unless forced."""
    return forced_backend() or ("triton" if device.type == "cuda" else "cpu")


def state_format(param, states, half_roles):
    """The format of a tensor's states (``states``: role to tensor) as the kernel names it, when
    they follow its rule (one dtype, except ``half_roles`` in bf16 beside 8-bit codes and a
    subset-norm second moment in fp32), else None."""
    full = {role: state.dtype for role, state in states.items() if state.shape == param.shape}
    pre_grad = None
    for role in half_roles:
        pre_grad = full.pop(role, pre_grad)
    dtypes = set(full.values())
    if len(dtypes) > 1:
        return None
    dtype = dtypes.pop() if dtypes else pre_grad or torch.float32  # only g_prev, or no param-shaped state
    expected_pre_grad = torch.bfloat16 if dtype == torch.uint8 else dtype
    if dtype not in fused_cpu.STATE_FORMATS or pre_grad not in (None, expected_pre_grad):
        return None
    if any(state.dtype != torch.float32 for state in states.values() if state.shape != param.shape):
        return None
    return fused_cpu.STATE_FORMATS[dtype]


def _backend_refusal(kind, param):
    """Why backend ``kind`` cannot run this tensor at all, or None."""
    if kind == "cpu":
        if not fused_cpu.AVAILABLE:
            return "the fused CPU kernel is not built (see the README's set-up)"
        if param.device.type != "cpu":
            return f"no fused kernel for {param.device.type} tensors yet"
        return None
    if fused_triton is None:
        return "Triton is not installed (pip install fastoptim[triton])"
    if param.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1)"
    if param.device.type not in ("cpu", "cuda"):
        return f"no Triton kernel for {param.device.type} tensors"
    return None


def _refusal(kind, param, grad, states, states_format):
    """Why backend ``kind``'s kernel cannot take this tensor (``states``: role to tensor,
    ``states_format``: their state_format), or None."""
    why = _backend_refusal(kind, param)
    if why:
        return why
    if param.dtype not in fused_cpu.DTYPES:
        return f"no fused kernel for {param.dtype}"
    if states_format is None:
        return "its states mix formats in a way the kernel does not know"
    if any(state.dtype == torch.uint8 for state in states.values()) and not all(
            t.is_contiguous() for t in (param, grad, *states.values())):
        return "8-bit states need a contiguous param and grad"
    states = list(states.values())
    if any(state.shape != param.shape for state in states):  # a subset-norm view: walked in row-major order
        if not all(t.is_contiguous() for t in (param, grad, *states)):
            return "a subset-norm param, grad and states must be contiguous"
        return None
    if not is_dense(param) or not all(same_layout(t, param) for t in (grad, *states)):
        return "param, grad and states are not dense with the same strides"
    return None


def same_layout(a, b):
    """Whether tensors of one shape order their elements alike (a size-1 dim's stride is free)."""
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n != 1)


def _split(plan, kind):
    """Indices backend ``kind``'s kernel takes with their states' formats, and those left to the
    foreach engine with the first reason."""
    state_roles = [role for role in plan.tensors if role not in ("param", "grad")]
    taken, formats, left, reason = [], [], [], None
    for i, (param, grad) in enumerate(zip(plan.tensors["param"], plan.tensors["grad"])):
        states = {role: plan.tensors[role][i] for role in state_roles}
        states_format = state_format(param, states, plan.spec.half)
        why = _refusal(kind, param, grad, states, states_format)
        if why:
            left.append(i)
            reason = reason or why
        else:
            taken.append(i)
            formats.append(states_format)
    return taken, formats, left, reason


def _fallback(plan, reason):
    if plan.warn_fallback:
        warnings.warn(f"fastoptim: fused=True, but {reason}; those tensors take the foreach engine", stacklevel=4)
    if plan.found_inf is not None and plan.found_inf.item():  # the foreach engine cannot skip without a sync
        return
    foreach.run(plan)


def _scalar_values(plan, device):
    """The kernel's scalars, name to value: a Python number, a 0-d tensor, or a 1-d tensor with one
    value per tensor (``plan.per_tensor``). The seed of stochastic rounding is drawn on ``device``."""
    seed = torch.randint(1 << 24, (), device=device) if plan.stochastic_rounding else 0
    values = plan.kernel_scalars(plan.args)
    return values | dict(found_inf=0.0 if plan.found_inf is None else plan.found_inf, seed=seed)


def _cpu_scalars(plan):
    """The C kernel's scalars as a ctypes array of (pointer, stride), and the tensors it points into."""
    values, names = _scalar_values(plan, "cpu"), plan.spec.all_scalars
    numbers = torch.tensor([0.0 if isinstance(values[n], torch.Tensor) else float(values[n]) for n in names])
    keep, array = [numbers], (fused_cpu.Scalar * len(names))()
    for i, name in enumerate(names):
        value = values[name]
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float32).contiguous()
            keep.append(value)
            array[i] = fused_cpu.Scalar(value.data_ptr(), 1 if name in plan.per_tensor else 0)
        else:
            array[i] = fused_cpu.Scalar(numbers.data_ptr() + 4 * i, 0)
    return array, keep


def _device_scalars(plan, table, device):
    """The Triton kernels' scalars: an fp32 tensor on ``device`` with one row per tensor when one
    of them is per tensor, else one shared row. Tensor values (a tensor lr, the clip coefficient,
    found_inf, the step's bias corrections, the seed of stochastic rounding) never leave the device;
    the plain numbers are sent once and kept with ``table`` while they stay the same. So a step sends
    nothing to the device and waits for nothing: it can be captured in a CUDA graph once warmed up."""
    values, names = _scalar_values(plan, device), plan.spec.all_scalars
    rows = len(plan) if any(name in plan.per_tensor for name in names) else 1
    numbers = tuple(0.0 if isinstance(values[n], torch.Tensor) else float(values[n]) for n in names)
    if table.numbers is None or table.numbers[0] != numbers:
        table.numbers = numbers, torch.tensor(numbers, device=device)
    return torch.stack([values[n].to(device, torch.float32).expand(rows) if isinstance(values[n], torch.Tensor)
                        else table.numbers[1][i].expand(rows) for i, n in enumerate(names)], dim=1)


def _prepare(plan, kind):
    """What backend ``kind``'s kernel takes of ``plan``, and its pointer tables, cached in
    ``plan.cache`` (which the optimizer empties whenever a param or state tensor changes) while
    the grads keep their layouts. Only the grads' pointers are refreshed every step."""
    grads = plan.tensors["grad"]
    prepared = plan.cache.get("prepared")
    if (prepared is None or prepared.kind != kind
            or not all(map(operator.eq, map(torch.Tensor.stride, grads), prepared.grad_strides))):
        prepared = plan.cache["prepared"] = Prepared(plan, kind, plan.spec.rows)
    pointers = data_pointers(grads)
    for indices, table, _ in prepared.tables:
        table.refresh_grads(pointers[indices])
    return prepared


class Prepared:
    """What backend ``kind``'s kernel takes of a plan (``taken``), what it leaves to foreach and why,
    and the pointer tables: (indices in the plan, table, state dtype). The C kernel reads each
    tensor's state format from its one table; a Triton kernel is compiled for one state dtype, so
    it gets a table per format (in practice a group's states share one)."""

    def __init__(self, plan, kind, roles):
        self.kind = kind
        self.taken, formats, self.left, self.reason = _split(plan, kind)
        groups = {}  # positions in taken, by table
        for position, state_format in enumerate(formats):
            groups.setdefault(state_format if kind == "triton" else None, []).append(position)
        dtypes = {code: dtype for dtype, code in fused_cpu.STATE_FORMATS.items()}
        self.tables = []
        for state_format, positions in groups.items():
            indices, table_formats = [self.taken[k] for k in positions], [formats[k] for k in positions]
            tensors = {role: [t[i] for i in indices] for role, t in plan.tensors.items()}
            tensors |= {role + "_absmax": [values[i] for i in indices] for role, values in plan.absmax.items()}
            blocks = [blockwise8.BLOCK if f == fused_cpu.STATE_FORMATS[torch.uint8] else 1 for f in table_formats]
            self.tables.append((indices, PointerTable(tensors, roles, table_formats, blocks), dtypes.get(state_format)))
        self.grad_strides = [grad.stride() for grad in plan.tensors["grad"]]


def _run(plan, per_tensor_calls):
    if plan.kernel_scalars is None:
        _fallback(plan, f"no fused kernel for {plan.spec.name} yet")
        return
    kind = backend(plan.tensors["param"][0].device)
    prepared = _prepare(plan, kind)
    if prepared.left:
        _fallback(plan.subset(prepared.left), prepared.reason)
    device, dtype = plan.tensors["param"][0].device, plan.tensors["param"][0].dtype
    for indices, table, state_dtype in prepared.tables:
        part = plan if len(indices) == len(plan) else plan.subset(indices)
        ranges = zip(table.first_chunk[:-1], table.first_chunk[1:]) if per_tensor_calls else [(0, len(table.chunks))]
        if kind == "cpu":
            scalars, _keep = _cpu_scalars(part)
            flags = plan.spec.flag_bits(plan.flags, part.stochastic_rounding)
            for chunk_range in ranges:
                fused_cpu.run(plan.spec, table.pointers, len(part), table.chunks, chunk_range, table.layouts,
                              scalars, dtype, flags, torch.get_num_threads())
            continue
        pointers, work = table.device_tables(device)
        scalars = _device_scalars(part, table, device)
        for first, last in ranges:
            fused_triton.launch(plan.spec, pointers, len(part), work[first:last], scalars, dtype, state_dtype,
                                stochastic=part.stochastic_rounding, subsets=bool((table.subsets > 1).any()),
                                flags=plan.flags)


def run_multi(plan):
    _run(plan, per_tensor_calls=False)


def run_single(plan):
    _run(plan, per_tensor_calls=True)
