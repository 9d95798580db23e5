"""The fused CPU engine (``fused=True``): the C kernel of ``fastoptim/kernels/fused_cpu.c``.

Multi-tensor (``foreach=True``, the default with ``fused=True``): one call per bucket updates every
tensor, parallel over fixed-size chunks across all of them. Single-tensor (``foreach=False``): one
call per tensor, as the seeds' FusedAdan does. Both read the pointer table and chunk plan cached in
``plan.cache``; only the gradients' row is refreshed each step.

States may be fp32, bf16 or 8-bit (``state_bits``): the kernel dequantizes, updates and
requantizes each 256-element block in one pass.

Tensors the kernel cannot take run on the foreach engine instead, with one warning when fused was
asked for: no build, a dtype other than fp32/bf16/fp16, a device other than the CPU, a layout
where param, grad and states are not dense with the same strides, or 8-bit states of a param
that is not contiguous (the codes are in row-major order).
"""
import operator
import warnings

import torch

from ..kernels import fused_cpu
from ..multi_tensor import PointerTable, data_pointers, is_dense
from ..states import blockwise8
from . import foreach


def state_format(param, states):
    """The format of a tensor's states (``states``: role to tensor) as the kernel names it, when
    they follow its rule (one dtype, except Adan's neg_pre_grad in bf16 beside 8-bit codes and a
    subset-norm second moment in fp32), else None."""
    full = {role: state.dtype for role, state in states.items() if state.shape == param.shape}
    pre_grad = full.pop("neg_pre_grad", None)
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


def _refusal(param, grad, states, states_format):
    """Why the kernel cannot take this tensor (``states``: role to tensor, ``states_format``:
    their state_format), or None."""
    if not fused_cpu.AVAILABLE:
        return "the fused CPU kernel is not built (see the README's set-up)"
    if param.device.type != "cpu":
        return f"no fused kernel for {param.device.type} tensors yet"
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


def _split(plan):
    """Indices the kernel takes with their states' formats, and those left to the foreach engine
    with the first reason."""
    state_roles = [role for role in plan.tensors if role not in ("param", "grad")]
    taken, formats, left, reason = [], [], [], None
    for i, (param, grad) in enumerate(zip(plan.tensors["param"], plan.tensors["grad"])):
        states = {role: plan.tensors[role][i] for role in state_roles}
        states_format = state_format(param, states)
        why = _refusal(param, grad, states, states_format)
        if why:
            left.append(i)
            reason = reason or why
        else:
            taken.append(i)
            formats.append(states_format)
    return taken, formats, left, reason


def _fallback(algorithm, plan, reason):
    if plan.warn_fallback:
        warnings.warn(f"fastoptim: fused=True, but {reason}; those tensors take the foreach engine", stacklevel=4)
    if plan.found_inf is not None and plan.found_inf.item():  # the foreach engine cannot skip without a sync
        return
    foreach.run(algorithm, plan)


def _scalars(algorithm, plan):
    """The kernel's scalars as a ctypes array of (pointer, stride), and the tensors it points into."""
    values = algorithm.kernel_scalars(plan.args)
    values |= dict(found_inf=0.0 if plan.found_inf is None else plan.found_inf,
                   seed=torch.randint(1 << 24, ()) if plan.stochastic_rounding else 0.0)
    names = fused_cpu.SCALARS[algorithm.kernel]
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


def _prepare(algorithm, plan):
    """What the kernel takes of ``plan``, and its pointer table, cached in ``plan.cache`` (which the
    optimizer empties whenever a param or state tensor changes) while the grads keep their layouts.
    Only the grads' pointers are refreshed every step."""
    grads = plan.tensors["grad"]
    prepared = plan.cache.get("prepared")
    if prepared is None or not all(map(operator.eq, map(torch.Tensor.stride, grads), prepared.grad_strides)):
        prepared = plan.cache["prepared"] = Prepared(plan, fused_cpu.ROLES[algorithm.kernel])
    pointers = data_pointers(grads)
    prepared.table.refresh_grads(pointers[prepared.taken] if prepared.left else pointers)
    return prepared


class Prepared:
    """What the kernel takes of a plan, what it leaves to foreach and why, and the pointer table."""

    def __init__(self, plan, roles):
        self.taken, formats, self.left, self.reason = _split(plan)
        tensors = {role: [t[i] for i in self.taken] for role, t in plan.tensors.items()}
        tensors |= {role + "_absmax": [values[i] for i in self.taken] for role, values in plan.absmax.items()}
        blocks = [blockwise8.BLOCK if f == fused_cpu.STATE_FORMATS[torch.uint8] else 1 for f in formats]
        self.table = PointerTable(tensors, roles, formats, blocks)
        self.grad_strides = [grad.stride() for grad in plan.tensors["grad"]]


def _run(algorithm, plan, per_tensor_calls):
    if algorithm.kernel is None:
        _fallback(algorithm, plan, f"no fused kernel for {type(algorithm).__name__} yet")
        return
    prepared = _prepare(algorithm, plan)
    table = prepared.table
    if prepared.left:
        _fallback(algorithm, plan.subset(prepared.left), prepared.reason)
        if not prepared.taken:
            return
        plan = plan.subset(prepared.taken)
    scalars, _keep = _scalars(algorithm, plan)
    flags = ((fused_cpu.AMSGRAD if "max_exp_avg_sq" in plan.tensors else 0)
             | (fused_cpu.NO_FIRST_MOMENT if "exp_avg" not in plan.tensors else 0)
             | (fused_cpu.STOCHASTIC_ROUNDING if plan.stochastic_rounding else 0))
    ranges = zip(table.first_chunk[:-1], table.first_chunk[1:]) if per_tensor_calls else [(0, len(table.chunks))]
    for chunk_range in ranges:
        fused_cpu.run(algorithm.kernel, table.pointers, len(plan), table.chunks, chunk_range, table.layouts, scalars,
                      plan.tensors["param"][0].dtype, flags, torch.get_num_threads())


def run_multi(algorithm, plan):
    _run(algorithm, plan, per_tensor_calls=False)


def run_single(algorithm, plan):
    _run(algorithm, plan, per_tensor_calls=True)
