"""The fused engines (``fused=True``): a backend's kernel (``engines/backends``: the C kernel for CPU
tensors, the Triton kernels for CUDA ones) over the tensors it takes; this module splits a plan
between the kernel and the foreach fallback, and caches the pointer tables.

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
import warnings

import torch

from ..multi_tensor import PointerTable, data_pointers, is_dense
from ..states import formats
from . import backends, foreach


def state_format(param, states, spec):
    """The format of a tensor's states (``states``: role to tensor) as one kernel variant takes them,
    when they follow its rule (one format, except the spec's ``half`` roles in bf16 beside 8-bit
    codes, and subset-norm second moments in fp32), else None."""
    full = {role: formats.of(state) for role, state in states.items() if state.shape == param.shape}
    half = {full.pop(role) for role in spec.half if role in full}
    kept = set(full.values()) or half or {formats.FP32}  # only a half role, or no param-shaped state
    if len(kept) > 1 or None in kept:
        return None
    kept = kept.pop()
    if kept.kernel_code is None or half - {formats.BF16 if kept is formats.Q8 else kept}:
        return None
    if any(formats.of(state) is not formats.FP32 for state in states.values() if state.shape != param.shape):
        return None
    return kept


def _refusal(backend, param, grad, states, states_format):
    """Why ``backend``'s kernel cannot take this tensor (``states``: role to tensor,
    ``states_format``: their state_format), or None."""
    why = backend.refusal(param)
    if why:
        return why
    if states_format is None:
        return "its states mix formats in a way the kernel does not know"
    if param.numel() == 0:  # nothing to walk, whatever the strides
        return None
    if states_format.block > 1 and not all(t.is_contiguous() for t in (param, grad, *states.values())):
        return f"{states_format} states need a contiguous param and grad"
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


def _split(plan, backend):
    """Indices ``backend``'s kernel takes with their states' formats, and those left to the foreach
    engine with the first reason."""
    state_roles = [role for role in plan.tensors if role not in ("param", "grad")]
    taken, taken_formats, left, reason = [], [], [], None
    for i, (param, grad) in enumerate(zip(plan.tensors["param"], plan.tensors["grad"])):
        states = {role: plan.tensors[role][i] for role in state_roles}
        states_format = state_format(param, states, plan.spec)
        why = _refusal(backend, param, grad, states, states_format)
        if why:
            left.append(i)
            reason = reason or why
        else:
            taken.append(i)
            taken_formats.append(states_format)
    return taken, taken_formats, left, reason


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


def _prepare(plan, backend):
    """What ``backend``'s kernel takes of ``plan``, and its pointer tables, cached in ``plan.cache``
    (which the optimizer empties whenever a param or state tensor changes) while the grads keep
    their layouts. Only the grads' pointers are refreshed every step."""
    grads = plan.tensors["grad"]
    prepared = plan.cache.get("prepared")
    if (prepared is None or prepared.backend is not backend
            or not all(map(operator.eq, map(torch.Tensor.stride, grads), prepared.grad_strides))):
        prepared = plan.cache["prepared"] = Prepared(plan, backend)
    pointers = data_pointers(grads)
    for indices, table, _ in prepared.tables:
        table.refresh_grads(pointers[indices])
    return prepared


class Prepared:
    """What ``backend``'s kernel takes of a plan (``taken``), what it leaves to foreach and why, and
    the pointer tables: (indices in the plan, table, state format: None where the table mixes
    them). A backend that compiles a kernel per state format gets a table per format (in practice
    a group's states share one)."""

    def __init__(self, plan, backend):
        self.backend = backend
        self.taken, taken_formats, self.left, self.reason = _split(plan, backend)
        groups = {}  # positions in taken, by table
        for position, states_format in enumerate(taken_formats):
            groups.setdefault(states_format if backend.SPLITS_FORMATS else None, []).append(position)
        self.tables = []
        for table_format, positions in groups.items():
            indices, table_formats = [self.taken[k] for k in positions], [taken_formats[k] for k in positions]
            tensors = {role: [t[i] for i in indices] for role, t in plan.tensors.items()}
            tensors |= {role + "_absmax": [values[i] for i in indices] for role, values in plan.absmax.items()}
            table = PointerTable(tensors, plan.spec.rows, [f.kernel_code for f in table_formats],
                                 [f.block for f in table_formats])
            self.tables.append((indices, table, table_format))
        self.grad_strides = [grad.stride() for grad in plan.tensors["grad"]]


def _run(plan, per_tensor_calls):
    if plan.kernel_scalars is None:
        _fallback(plan, f"no fused kernel for {plan.spec.name} yet")
        return
    backend = backends.for_device(plan.tensors["param"][0].device)
    prepared = _prepare(plan, backend)
    if prepared.left:
        _fallback(plan.subset(prepared.left), prepared.reason)
    for indices, table, table_format in prepared.tables:
        part = plan if len(indices) == len(plan) else plan.subset(indices)
        ranges = zip(table.first_chunk[:-1], table.first_chunk[1:]) if per_tensor_calls else [(0, len(table.chunks))]
        backend.run(part, table, list(ranges), table_format, _scalar_values(part, part.tensors["param"][0].device))


def run_multi(plan):
    _run(plan, per_tensor_calls=False)


def run_single(plan):
    _run(plan, per_tensor_calls=True)
