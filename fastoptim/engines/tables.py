"""What a fused kernel takes of a bucket, and the tables it takes it as: which tensors a backend's
kernel can walk (their states' formats and layouts: :func:`split_taken`), and :class:`Tables`, the
pointer tables of those tensors bound to the backend, which the fused engine, the bound step and the
traced step's op launch."""
import operator

import torch

from ..multi_tensor import PointerTable, is_dense, pick
from ..specs import ABSMAX
from ..states import formats, master


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


def _refusal(backend, param, grad, states, states_format, remainder, maxima):
    """Why ``backend``'s kernel cannot take this tensor (``states``: role to tensor,
    ``states_format``: their state_format, ``remainder``: its master remainder or None, ``maxima``: its
    8-bit states' block maxima), or None."""
    why = backend.refusal(param)
    if why:
        return why
    if states_format is None:
        return "its states mix formats in a way the kernel does not know"
    if param.numel() == 0:  # nothing to walk, whatever the strides
        return None
    if remainder is not None and not same_layout(remainder, param):
        return "a master remainder is not laid out as its param"
    if not all(t.is_contiguous() for t in maxima):  # walked as one block after another
        return "8-bit states' block maxima must be contiguous"
    if states_format.block > 1 and not all(t.is_contiguous() for t in (param, grad, *states.values())):
        return f"{states_format} states need a contiguous param, grad and states"
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


def split_taken(tensors, absmax, spec, backend):
    """Indices of the tensors (``tensors``: role to one tensor per param; ``absmax``: role to each param's
    block maxima or None) that ``backend``'s kernel takes, with their states' formats, and those left to
    the foreach engine with the first reason."""
    remainders = tensors.get(master.KEY)
    if remainders is not None and not backend.REMAINDERS:
        return [], [], list(range(len(tensors["param"]))), f"the {backend.NAME} kernels keep no master_bits remainders"
    state_roles = [role for role in tensors if role not in ("param", "grad", master.KEY)]
    taken, taken_formats, left, reason = [], [], [], None
    for i, (param, grad) in enumerate(zip(tensors["param"], tensors["grad"])):
        states = {role: tensors[role][i] for role in state_roles}
        states_format = state_format(param, states, spec)
        maxima = [values[i] for values in absmax.values() if values[i] is not None]
        why = _refusal(backend, param, grad, states, states_format, None if remainders is None else remainders[i],
                       maxima)
        if why:
            left.append(i)
            reason = reason or why
        else:
            taken.append(i)
            taken_formats.append(states_format)
    return taken, taken_formats, left, reason


class Tables:
    """The tables of tensors that ``backend``'s kernel takes, every one (``formats``: their states'
    formats): (indices, index tensor or None for all, what the backend binds of the table, state
    format: None where the table mixes them). A backend that compiles a kernel per state format gets
    a table per format (in practice a group's states share one). The grads come with each launch.
    The rest holds while the tensors keep their storage and layouts, which a backend that
    ``CHECKS_NATIVELY`` checks at every call, and the owner of the tables checks for the others.
    ``watched`` (per tensor, a tuple) are tensors that such a backend checks too, though its kernel
    does not walk them: the params' step counts; ``originals`` (by role, or None) the tensors that
    ``tensors`` are views of (a subset-norm param's and states' (a, b, c) views), which it binds and
    checks in their place (see ``GroupWork.read_tensors``). Where the backend computes ``STEP_SCALARS``,
    ``rule`` names what computes the kernel's scalars from a launch's ``options`` and ``counts`` (per
    tensor, the step count it reads; a group's, held by each of its tensors, counts once)."""

    def __init__(self, tensors, absmax, spec, backend, formats, watched=None, originals=None, rule="",
                 counts=None):
        self.backend = backend
        groups = {}  # positions, by table
        for position, states_format in enumerate(formats):
            groups.setdefault(states_format if backend.SPLITS_FORMATS else None, []).append(position)
        self.tables = []
        for table_format, indices in groups.items():
            part = pick(tensors, indices) | {role + ABSMAX: values for role, values in pick(absmax, indices).items()}
            table = PointerTable(part, spec.rows, [formats[i].kernel_code for i in indices],
                                 [formats[i].block for i in indices], backend.COLUMN_NUMEL, backend.BLOCK_COLUMNS)
            index = None if len(indices) == len(formats) else torch.tensor(indices, device=tensors["param"][0].device)
            scalars_here = backend.STEP_SCALARS and rule
            read = {id(counts[i]): counts[i] for i in indices} if scalars_here and counts is not None else {}
            watch = {} if watched is None else {id(t): t for i in indices for t in watched[i]}  # a counts tensor once
            watch = [t for key, t in watch.items() if key not in read]  # a count read is checked as it is read
            bound = backend.bind(spec, part, table, watch, None if originals is None else pick(originals, indices),
                                 rule if scalars_here else "", list(read.values()))
            self.tables.append((indices, index, bound, table_format))
        self.grad_strides = list(map(torch.Tensor.stride, tensors["grad"]))

    def bound(self):
        """What the backend bound of each table (for a backend that ``CHECKS_NATIVELY``, its ``holds``)."""
        return [bound for _, _, bound, _ in self.tables]

    def fit(self, grads):
        """Whether the grads have the layouts the tables were built with."""
        return all(map(operator.eq, map(torch.Tensor.stride, grads), self.grad_strides))

    def launch(self, spec, grads, scalars, flags, stochastic, per_tensor_calls, batch=None, options=None):
        """Run the kernel over every table, or append the launch of each to ``batch``: ``scalars``
        in ``spec.all_scalars`` order (a 1-d tensor holds one value per tensor), ``flags`` the
        spec's flags (name: bool); with ``options``, the tables' rule computes the scalars after the
        first three (see ``__init__``). Returns False, having changed nothing, when the backend found a
        tensor moved or a grad that does not fit."""
        flag_bits = spec.flag_bits(flags, stochastic)
        for indices, index, bound, table_format in self.tables:
            values = scalars if index is None else [
                value[index] if isinstance(value, torch.Tensor) and value.dim() == 1 else value for value in scalars]
            part = grads if index is None else [grads[i] for i in indices]
            launch = self.backend.launch(spec, bound, part, per_tensor_calls, table_format, values, flag_bits, options)
            if batch is not None:
                batch.append(launch)
            elif not self.backend.run_launches([launch]):
                return False
        return True
