"""The fused engines (``fused=True``): a backend's kernel (``engines/backends``: the C kernel for CPU
tensors, the Triton kernels for CUDA ones) over the tensors it takes; this module splits a plan
between the kernel and the foreach fallback, and caches the pointer tables.

Multi-tensor (``foreach=True``, the default with ``fused=True``): one call per bucket updates every
tensor, parallel over fixed-size chunks across all of them. Single-tensor (``foreach=False``): one
kernel call (or launch) per tensor, as the seeds' FusedAdan does. Both read the tables cached in
``plan.cache``: the params and states bound to native code, which checks them and the grads at every
call (a bound step launches its tables without a plan: ``bound_step.BoundStep``); on the GPU also the pointer
table, whose gradients' row is refreshed each step (and sent to the device only when a grad moved).

States may be fp32, bf16 or 8-bit (``state_bits``): the C kernel dequantizes, updates and
requantizes each 256-element block in one pass, and so do the Triton kernels.

Tensors the kernel cannot take run on the foreach engine instead, with one warning when fused was
asked for: no build (or no Triton), a dtype other than fp32/bf16/fp16, a device the backend does not
run on, a layout where param, grad and states are not dense with the same strides, or 8-bit states
of a param that is not contiguous (the codes are in row-major order).
"""
import operator
import warnings
import weakref
from itertools import repeat
from typing import NamedTuple

import torch

from ..multi_tensor import PointerTable, disjoint, is_dense, pick
from ..specs import ABSMAX, COMMON_SCALARS
from ..states import blockwise8, formats, master
from ..step_cache import DEVICE, DTYPE, LAYOUT, SHAPE, OpCache, Signature
from . import amp, backends, foreach


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


def _refusal(backend, param, grad, states, states_format, remainder):
    """Why ``backend``'s kernel cannot take this tensor (``states``: role to tensor,
    ``states_format``: their state_format, ``remainder``: its master remainder or None), or None."""
    why = backend.refusal(param)
    if why:
        return why
    if states_format is None:
        return "its states mix formats in a way the kernel does not know"
    if param.numel() == 0:  # nothing to walk, whatever the strides
        return None
    if remainder is not None and not same_layout(remainder, param):
        return "a master remainder is not laid out as its param"
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


def _split(tensors, spec, backend):
    """Indices of the tensors (``tensors``: role to one tensor per param) that ``backend``'s kernel
    takes, with their states' formats, and those left to the foreach engine with the first reason."""
    remainders = tensors.get(master.KEY)
    if remainders is not None and not backend.REMAINDERS:
        return [], [], list(range(len(tensors["param"]))), f"the {backend.NAME} kernels keep no master_bits remainders"
    state_roles = [role for role in tensors if role not in ("param", "grad", master.KEY)]
    taken, taken_formats, left, reason = [], [], [], None
    for i, (param, grad) in enumerate(zip(tensors["param"], tensors["grad"])):
        states = {role: tensors[role][i] for role in state_roles}
        states_format = state_format(param, states, spec)
        why = _refusal(backend, param, grad, states, states_format, None if remainders is None else remainders[i])
        if why:
            left.append(i)
            reason = reason or why
        else:
            taken.append(i)
            taken_formats.append(states_format)
    return taken, taken_formats, left, reason


class TracedSplit(NamedTuple):
    """A traced step's split of a bucket, decided before tracing (``split``): the indices the kernel
    takes, those left to the foreach engine and why, and the op's call over the taken tensors (None
    where it takes none), which the split holds: the op finds it while it lives."""
    taken: list
    left: list
    reason: str | None
    call: "PreparedCall | None" = None


def split(tensors, absmax, spec, originals=None, remake=None):
    """A traced step's :class:`TracedSplit` of one bucket (``tensors``: role to one tensor per param,
    grads included; ``absmax``: role to each param's block maxima or None). The op's call over the
    taken tensors is prepared here, eagerly, on the user's own state tensors (``originals``, of
    which ``tensors`` may be views: a subset-norm param's), and ``remake(taken)`` makes the taken
    tensors' (tensors, absmax) afresh from them (see :class:`PreparedCall`)."""
    if master.KEY in tensors:  # the step ops take no remainders
        return TracedSplit([], list(range(len(tensors["param"]))),
                           "a compiled step's kernels keep no master_bits remainders")
    taken, _, left, reason = _split(tensors, spec, backends.for_device(tensors["param"][0].device))
    if not taken:
        return TracedSplit(taken, left, reason)
    states, absmax = pick(tensors, taken, leave=("grad",)), pick(absmax, taken)
    holders, layout = op_states(states, absmax, spec)
    call = _PREPARED[id(layout)] = PreparedCall(states["param"], holders, layout, states, absmax, originals,
                                                lambda: remake(taken))
    return TracedSplit(taken, left, reason, call)


def _warn_at_tracing(ctx):
    warnings.warn(ctx.get_local("message").as_python_constant())


def warn(message, stacklevel):
    """``warnings.warn``, also in a step that torch.compile traces, where it warns once, at tracing
    (a traced ``warnings.warn`` would break the graph)."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime  # loaded by now: dynamo is tracing
        comptime(_warn_at_tracing)  # reads ``message``, the one local it may see
    else:
        warnings.warn(message, stacklevel=stacklevel + 1)


def _fallback(plan, reason):
    if plan.warn_fallback:
        warn(f"fastoptim: fused=True, but {reason}; those tensors take the foreach engine", stacklevel=4)
    amp.run_unless_inf(foreach.run, plan)


def _found_inf_and_seed(found_inf, stochastic, device):
    """GradScaler's ``found_inf`` (None: 0) and, with ``stochastic`` rounding, a seed drawn on ``device``."""
    return dict(found_inf=0.0 if found_inf is None else found_inf,
                seed=torch.randint(1 << 24, (), device=device) if stochastic else 0)


def kernel_values(kernel_scalars, args, found_inf, stochastic, device):
    """The kernel's scalars by name, ``kernel_scalars(args)`` with GradScaler's ``found_inf`` (or None)
    and, with ``stochastic`` rounding, its seed, drawn on ``device``: Python numbers, 0-d tensors, or
    1-d tensors with one value per tensor."""
    return kernel_scalars(args) | _found_inf_and_seed(found_inf, stochastic, device)


def common_scalars(spec, grad_scale, found_inf, stochastic, device):
    """The scalars of a launch whose table's rule computes the rest (see :class:`Tables`): found_inf,
    the seed and the grad scale (None: 1) as :func:`kernel_values` makes them, then zeros."""
    values = _found_inf_and_seed(found_inf, stochastic, device) | {"grad_scale": 1.0 if grad_scale is None
                                                                   else grad_scale}
    return [values[name] for name in COMMON_SCALARS] + [0.0] * len(spec.scalars)


def ordered_scalars(spec, kernel_scalars, args, found_inf, stochastic, device, values=None):
    """The kernel's scalars in ``spec.all_scalars`` order: ``values`` (by name), or by default
    :func:`kernel_values` of the other arguments."""
    if values is None:
        values = kernel_values(kernel_scalars, args, found_inf, stochastic, device)
    return [values[name] for name in spec.all_scalars]


def _scalar_values(plan, device):
    """The kernel's scalars of ``plan`` in its spec's order (see :func:`ordered_scalars`)."""
    return ordered_scalars(plan.spec, plan.kernel_scalars, plan.args, plan.found_inf, plan.stochastic_rounding,
                           device, plan.kernel_values)


class Tables:
    """The tables of tensors that ``backend``'s kernel takes, every one (``formats``: their states'
    formats): (indices, index tensor or None for all, what the backend binds of the table, state
    format: None where the table mixes them). A backend that compiles a kernel per state format gets
    a table per format (in practice a group's states share one). The grads come with each launch.
    The rest holds while the tensors keep their storage and layouts, which a backend that
    ``CHECKS_NATIVELY`` checks at every call, and the owner of the tables checks for the others.
    ``watched`` (per tensor, a tuple) are tensors that such a backend checks too, though its kernel
    does not walk them: those the tensors are views of, and the params' step counts; ``grads_like``
    (per tensor, or None) what else a grad may come laid out as: the user's param where ``tensors``
    holds a view of it (see ``GroupWork.watched``). Where the backend computes ``STEP_SCALARS``,
    ``rule`` names what computes the kernel's scalars from a launch's ``options`` and ``counts`` (per
    tensor, the step count it reads; a group's, held by each of its tensors, counts once)."""

    def __init__(self, tensors, absmax, spec, backend, formats, watched=None, grads_like=None, rule="",
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
            like = () if grads_like is None else [grads_like[i] for i in indices]
            scalars_here = backend.STEP_SCALARS and rule
            read = {id(counts[i]): counts[i] for i in indices} if scalars_here and counts is not None else {}
            watch = {} if watched is None else {id(t): t for i in indices for t in watched[i]}  # a counts tensor once
            watch = [t for key, t in watch.items() if key not in read]  # a count read is checked as it is read
            bound = backend.bind(spec, part, table, watch, like, rule if scalars_here else "", list(read.values()))
            self.tables.append((indices, index, bound, table_format))
        self.grad_strides = list(map(torch.Tensor.stride, tensors["grad"]))

    def fit(self, grads):
        """Whether the grads have the layouts the tables were built with."""
        return all(map(operator.eq, map(torch.Tensor.stride, grads), self.grad_strides))

    def launch(self, spec, grads, scalars, flags, stochastic, per_tensor_calls, batch=None, options=None):
        """Run the kernel over every table, or append the launch of each to ``batch``: ``scalars``
        in ``spec.all_scalars`` order (a 1-d tensor holds one value per tensor), ``flags`` the
        spec's flags (name: bool); with ``options``, the tables' rule computes the scalars after the
        first three (see ``__init__``). Returns False, having changed nothing, when the backend found a
        tensor moved or a grad that does not fit."""
        for indices, index, bound, table_format in self.tables:
            values = scalars if index is None else [
                value[index] if isinstance(value, torch.Tensor) and value.dim() == 1 else value for value in scalars]
            part = grads if index is None else [grads[i] for i in indices]
            launch = self.backend.launch(spec, bound, part, per_tensor_calls, table_format, values, flags, stochastic,
                                         options)
            if batch is not None:
                batch.append(launch)
            elif not self.backend.run_launches([launch]):
                return False
        return True


class Prepared:
    """What ``backend``'s kernel takes of a plan (``taken``), what it leaves to foreach and why, and
    the :class:`Tables` of what it takes."""

    def __init__(self, plan, backend):
        self.backend = backend
        self.counts = plan.counts  # the count tensors its tables read and advance natively (see _prepare)
        self.taken, formats, self.left, self.reason = _split(plan.tensors, plan.spec, backend)
        taken = plan if not self.left else plan.subset(self.taken)
        self.tables = Tables(taken.tensors, taken.absmax, plan.spec, backend, formats, taken.watched,
                             taken.grads_like, plan.rule, taken.counts) if self.taken else None


def _same_counts(held, given):
    """Whether the count tensors that tables were bound with (``held``) are the plan's now: a group's
    count set anew (official Adan's int, or another tensor) leaves the states as they were, and a
    bound step's native call would read and advance the old one."""
    return held is given or (held is not None and given is not None and len(held) == len(given)
                             and all(map(operator.is_, held, given)))


def _prepare(plan, backend, again=False):
    """What ``backend``'s kernel takes of ``plan``, cached in ``plan.cache`` (which the optimizer
    empties whenever a param or state tensor changes), built ``again`` when a launch found a tensor
    moved, and, for a backend that does not check natively, when the grads changed their layouts."""
    prepared = plan.cache.get("prepared")
    if again or prepared is None or prepared.backend is not backend or not _same_counts(prepared.counts,
                                                                                         plan.counts) or (
            not backend.CHECKS_NATIVELY and prepared.tables is not None and not prepared.tables.fit(
                plan.tensors["grad"] if not prepared.left else [plan.tensors["grad"][i] for i in prepared.taken])):
        prepared = plan.cache["prepared"] = Prepared(plan, backend)
    return prepared


def _launch(plan, prepared, per_tensor_calls):
    """Launch the kernel over what it takes of ``plan``; False when the backend changed nothing."""
    taken = plan if not prepared.left else plan.subset(prepared.taken)
    scalars = _scalar_values(taken, taken.tensors["param"][0].device)
    return prepared.tables.launch(plan.spec, taken.tensors["grad"], scalars, plan.flags, plan.stochastic_rounding,
                                  per_tensor_calls)


def natively_checked(cache):
    """Whether the bucket whose engine cache is ``cache`` runs wholly on tables that a backend which
    ``CHECKS_NATIVELY`` built, and so can join a bound step (see ``bound_step.BoundStep``)."""
    prepared = cache.get("prepared")
    return prepared is not None and prepared.backend.CHECKS_NATIVELY and prepared.tables is not None \
        and not prepared.left


def _run(plan, per_tensor_calls):
    if plan.kernel_scalars is None:
        _fallback(plan, f"no fused kernel for {plan.spec.name} yet")
        return
    if torch.compiler.is_compiling():
        _run_traced(plan, per_tensor_calls)
        return
    backend = backends.for_device(plan.tensors["param"][0].device)
    prepared = _prepare(plan, backend)
    if prepared.tables is not None and not _launch(plan, prepared, per_tensor_calls):
        prepared = _prepare(plan, backend, again=True)  # what moved or no longer fits is split again
        if prepared.tables is not None and not _launch(plan, prepared, per_tensor_calls):
            raise RuntimeError("fastoptim: the fused kernel refused tables built from the tensors just now")
    if prepared.left:
        _fallback(plan.subset(prepared.left), prepared.reason)


def run_multi(plan):
    _run(plan, per_tensor_calls=False)


def run_single(plan):
    _run(plan, per_tensor_calls=True)


SINGLE, MULTI = "fused-single", "fused-multi"  # the fused engines' names
ENGINES = {SINGLE: run_single, MULTI: run_multi}


# --- the kernels as torch custom ops, which torch.compile keeps as one opaque call per bucket ------

OPS = {}  # spec name: its step op, torch.ops.fastoptim.<name>_step
_LIBRARY = torch.library.Library("fastoptim", "FRAGMENT")


def define_op(spec):
    """Define ``spec``'s step op: ``fastoptim::<name>_step(param, grad, states, layout, scalars,
    flags, per_tensor_calls)``, mutating the params and ``states``: the few tensors that hold every
    state and block maxima (flat buffers, or a state of its own), with ``layout`` saying where each
    is (see :func:`op_states`, which makes both). A compiled step hands the graph a handful of
    state tensors instead of one per state: inductor's time grows with the square of an op's
    mutated tensors. ``scalars`` in ``spec.all_scalars`` order, ``flags`` the kernel's flag bits.
    Defining it again is a no-op."""
    if spec.name in OPS:
        return
    name = f"{spec.name}_step"
    _LIBRARY.define(f"{name}(Tensor(a!)[] param, Tensor[] grad, Tensor(b!)[] states, Tensor layout, "
                    "Tensor[] scalars, int flags, bool per_tensor_calls) -> ()")

    def step(*args):
        _op_step(spec, *args)

    _LIBRARY.impl(name, step, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fastoptim::{name}", lambda *args: None, lib=_LIBRARY)
    OPS[spec.name] = getattr(torch.ops.fastoptim, name).default


def _state_names(spec):
    return (*spec.states, *(role + ABSMAX for role in spec.states))


def op_states(tensors, absmax, spec):
    """The ``states`` and ``layout`` arguments of ``spec``'s step op for ``tensors`` (role to one
    tensor per param) and ``absmax`` (role to each param's block maxima, None for none). Each state
    is held by its root tensor (a flat buffer holds many); ``layout`` is an int64 tensor of records,
    for each state role in ``spec.states`` order, then each role's block maxima, one per param:
    -1 where there is none, else the holder's index, the storage offset, the dimensions, the sizes
    and the strides."""
    n, holders, index, records = len(tensors["param"]), [], {}, []
    for name in _state_names(spec):
        values = tensors.get(name) if name in spec.states else absmax.get(name.removesuffix(ABSMAX))
        for state in values or repeat(None, n):
            if state is None:
                records.append(-1)
                continue
            holder = state._base if state._base is not None and state._base.dtype == state.dtype else state
            records += [index.setdefault(id(holder), len(holders)), state.storage_offset(), state.dim(),
                        *state.shape, *state.stride()]
            if index[id(holder)] == len(holders):
                holders.append(holder)
    return holders, torch.tensor(records, dtype=torch.int64)


def _within(holder, offset, sizes, strides):
    """Whether the view (``offset``, ``sizes``, ``strides``, in elements of its storage) lies within
    ``holder``'s elements, from its first to its last: the op mutates no memory it was not given."""
    if any(n == 0 for n in sizes):
        return True
    first = holder.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(holder.shape, holder.stride()))
    return holder.numel() > 0 and first <= offset and offset + sum((n - 1) * s for n, s in zip(sizes, strides)) <= last


def _read_states(op, spec, n, holders, layout):
    """The inverse of :func:`op_states`: (tensors, absmax) by role, views of ``holders``."""
    records, at, found = layout.tolist(), 0, {}
    try:
        for name in _state_names(spec):
            values = []
            for _ in range(n):
                if records[at] < 0:
                    values.append(None)
                    at += 1
                    continue
                holder, offset, dim = records[at:at + 3]
                sizes, strides = records[at + 3:at + 3 + dim], records[at + 3 + dim:at + 3 + 2 * dim]
                if len(strides) != dim or holder >= len(holders) or not _within(holders[holder], offset, sizes,
                                                                                 strides):
                    raise IndexError("a state lies outside its holder")
                values.append(holders[holder].as_strided(sizes, strides, offset))
                at += 3 + 2 * dim
            found[name] = values
        if at != len(records):
            raise IndexError
    except (IndexError, TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{op}: states and layout must be what fastoptim.engines.fused.op_states makes of "
                         f"{n} params' states ({error or 'the layout ends early or late'})") from None
    tensors = {role: found[role] for role in spec.states if any(t is not None for t in found[role])}
    absmax = {role: found[role + ABSMAX] for role in spec.states if any(t is not None for t in found[role + ABSMAX])}
    if any(t is None for ts in tensors.values() for t in ts):
        raise ValueError(f"{op}: a state role must hold one tensor per param (or none, for a role the step "
                         "does not keep)")
    return tensors, absmax


def _run_traced(plan, per_tensor_calls):
    """A step that torch.compile traces: the split was decided before tracing (``split``, called by
    the optimizer's ``_init_group``), and the kernel's tensors go to ``spec``'s op, which the graph
    keeps."""
    traced = plan.cache["traced split"]
    if traced.left:
        _fallback(plan.subset(traced.left), traced.reason)
    if not traced.taken:
        return
    part = plan if not traced.left else plan.subset(traced.taken)
    device = part.tensors["param"][0].device
    scalars = [value if isinstance(value, torch.Tensor) else torch.tensor(float(value), device=device)
               for value in _scalar_values(part, device)]
    OPS[plan.spec.name](part.tensors["param"], part.tensors["grad"], traced.call.holders, traced.call.layout, scalars,
                        plan.spec.flag_bits(part.flags, part.stochastic_rounding), per_tensor_calls)


class OpCall:
    """A step op's call as its tables were built for: its params, state holders and layout, the
    states by role, and the tables (with, for a backend that does not check natively, the held
    tensors' and the grads' signatures)."""

    def __init__(self, params, holders, layout, tensors, absmax):
        self.params, self.holders, self.layout, self.tensors, self.absmax = params, holders, layout, tensors, absmax
        self.flag_bits = self.tables = self.held = self.signature = self.grads_signature = None

    def build(self, spec, backend, flag_bits, tensors, absmax, taken_formats):
        """Bind the tables of ``tensors`` (role to one tensor per param, grads included) and
        ``absmax``, checked for ``flag_bits`` (flags decide the roles a kernel reads)."""
        self.held = [t for role, ts in tensors.items() if role != "grad" for t in ts] + [
            t for ts in absmax.values() for t in ts if t is not None]
        self.flag_bits, self.signature, self.grads_signature = flag_bits, Signature((), self.held), Signature(
            (), tensors["param"])
        self.tables = Tables(tensors, absmax, spec, backend, taken_formats)


class PreparedCall(OpCall):
    """A call that ``split`` prepared before tracing, on the user's own state tensors: kept by the
    optimizer's step cache (so it goes with the optimizer), found by the op through its layout.
    A state given new storage in place (``set_``, ``.data =``) is seen by the data pointers of
    ``originals`` (the user's tensors, of which the states may be views) and the call is made
    afresh from them (``remake``), so the kernel updates the state where it now lives."""

    def __init__(self, params, holders, layout, tensors, absmax, originals, remake):
        super().__init__(params, holders, layout, tensors, absmax)
        self.originals, self.remake = originals, remake
        self.pointers = list(map(torch.Tensor.data_ptr, originals))
        mine = set(map(id, originals))  # else the states are views of them, checked here at every call
        states = [t for role, ts in (*tensors.items(), *absmax.items()) if role != "param" for t in ts]
        self.viewed = not all(id(t) in mine for t in states if t is not None)

    def moved(self):
        """Whether one of the user's state tensors has moved since the call was made."""
        return list(map(torch.Tensor.data_ptr, self.originals)) != self.pointers

    def follow(self):
        """The call made afresh from the user's tensors where they now are."""
        self.tensors, self.absmax = self.remake()
        self.pointers = list(map(torch.Tensor.data_ptr, self.originals))
        self.tables = None


_PREPARED = weakref.WeakValueDictionary()  # id of a prepared call's layout: the call
# (spec name, id of the layout, which the entry holds): an OpCall made by the op itself
_OP_CACHE = OpCache()


def _is_real_number(tensor):
    return not (tensor.is_complex() or tensor.dtype == torch.bool)


def _check_op_scalars(op, spec, scalars, flag_bits, n_params, device):
    """Raise a ValueError naming the first bad scalar or flag of a step op's call."""
    if len(scalars) != len(spec.all_scalars):
        raise ValueError(f"{op}: scalars must hold {len(spec.all_scalars)} tensors, in the order "
                         f"{spec.all_scalars}; got {len(scalars)}")
    for name, value in zip(spec.all_scalars, scalars):
        if (not _is_real_number(value) or value.dim() > 1 or value.dim() == 1 and value.numel() != n_params
                or device is not None and value.device != device):
            raise ValueError(f"{op}: scalar {name!r} must be a real-number tensor on the params' device ({device}), "
                             f"0-d or 1-d with one value per param ({n_params}); got {value.dtype} of shape "
                             f"{tuple(value.shape)} on {value.device}")
    if not 0 <= flag_bits < 1 << (len(spec.flags) + 1):
        raise ValueError(f"{op}: flags must be the bits of stochastic rounding and {spec.flags}, as "
                         f"KernelSpec.flag_bits makes them; got {flag_bits}")


def _check_op_grads(op, param, grad):
    """Raise a ValueError if a grad is not a dense tensor of its param's shape, dtype and device."""
    for i, (p, g) in enumerate(zip(param, grad)):
        if g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(f"{op}: grad[{i}] must be a strided tensor of its param's shape, dtype and device "
                             f"({p.dtype} {tuple(p.shape)} on {p.device}); got {g.layout} {g.dtype} "
                             f"{tuple(g.shape)} on {g.device}")


def _check_op_states(op, spec, flags, tensors, absmax):
    """Raise a ValueError naming the first state or block-maxima tensor that does not fit its param:
    the roles the flags keep, and no other, one tensor per param on its device, of its shape (or a
    subset-norm second moment's (a, 1, c) beside an (a, b, c) param), 8-bit codes with exactly their
    blocks' maxima; and no two updated tensors sharing memory."""
    param = tensors["param"]
    kept = spec.kept(flags)
    for role in spec.states:
        if (role in tensors) != (role in kept):
            raise ValueError(f"{op}: {role} must " + ("hold one tensor per param: the flags keep it" if role in kept
                                                      else "be empty: the flags keep no such state"))
        if role in absmax and role not in kept:
            raise ValueError(f"{op}: {role}{ABSMAX} must be empty: the flags keep no {role}")
    for role in kept:
        for i, (p, state) in enumerate(zip(param, tensors[role])):
            reduced = role in spec.reduced and p.dim() == 3 and state.shape == (p.shape[0], 1, p.shape[2])
            if state.device != p.device or state.shape != p.shape and not reduced:
                raise ValueError(f"{op}: {role}[{i}] is {tuple(state.shape)} on {state.device}; its param is "
                                 f"{tuple(p.shape)} on {p.device}")
            maxima = absmax[role][i] if role in absmax else None
            blocks = (blockwise8.n_blocks(p.numel()),)
            if state.dtype == formats.Q8.dtype and (maxima is None or maxima.dtype != torch.float32
                                                    or maxima.shape != blocks or maxima.device != p.device):
                raise ValueError(f"{op}: {role}[{i}] holds 8-bit codes, so {role}{ABSMAX}[{i}] must be the fp32 "
                                 f"maxima of its {blocks[0]} blocks on {p.device}, got "
                                 + ("none" if maxima is None else f"{maxima.dtype} {tuple(maxima.shape)} on "
                                    f"{maxima.device}"))
            if state.dtype != formats.Q8.dtype and maxima is not None:
                raise ValueError(f"{op}: {role}{ABSMAX}[{i}] must be empty: {role}[{i}] holds no 8-bit codes")
    updated = [t for role, ts in tensors.items() if role != "grad" for t in ts]
    if not disjoint(updated + [t for ts in absmax.values() for t in ts if t is not None]):
        raise ValueError(f"{op}: two of the tensors it updates share memory (a param listed twice?); each param, "
                         "state and block-maxima tensor must own its memory")


def _same_tensors(given, kept):
    """Whether the tensors an op was handed are those a call was made with: the same objects, or
    views of the same memory made again (a subset-norm param's, which the graph views afresh)."""
    return len(given) == len(kept) and (all(map(operator.is_, given, kept)) or (
        list(map(torch.Tensor.data_ptr, given)) == list(map(torch.Tensor.data_ptr, kept))
        and all(map(operator.eq, map(SHAPE, given), map(SHAPE, kept)))))


def _op_step(spec, param, grad, holders, layout, scalars, flag_bits, per_tensor_calls):
    """The step op's eager implementation (see :func:`define_op`). Every argument is checked before
    anything changes. The tables are kept while calls pass the same params, holders and layout,
    and the tensors keep their storage and layouts: checked at each call by a backend that
    ``CHECKS_NATIVELY`` (which refuses to run a table whose tensors moved, or with a grad that does
    not fit), else here (:class:`Signature` over them, as the optimizer's step cache keeps its own,
    and the grads' shapes, dtypes, devices and strides). A call that ``split`` prepared runs on the
    user's own state tensors and follows one given new storage in place; where a backend hands the
    op copies of its tensors (aot_eager), such a move is refused, as the copies' updates would not
    reach the state the user sees."""
    op = f"fastoptim::{spec.name}_step"
    _check_op_scalars(op, spec, scalars, flag_bits, len(param), param[0].device if param else None)
    if len(grad) != len(param):
        raise ValueError(f"{op}: grad must hold one tensor per param; got {len(grad)} for {len(param)} params")
    if not param:
        return
    flags, stochastic = spec.unpack_flags(flag_bits)
    backend = backends.for_device(param[0].device)
    call = _PREPARED.get(id(layout)) or _OP_CACHE.get((spec.name, id(layout)))
    call = call if call is not None and call.layout is layout else None
    prepared = isinstance(call, PreparedCall)
    same = call is not None and _same_tensors(param, call.params) and _same_tensors(holders, call.holders)
    if prepared and not same and call.moved():
        raise RuntimeError(f"{op}: a state was given new storage in place (set_, .data =, share_memory_()) after "
                           "the step was compiled, and this backend hands the op copies of its tensors: assign "
                           "the new tensor in the state dict instead (optimizer.state[param][key] = tensor), "
                           "which traces the step again")
    if prepared and same and call.viewed and call.moved():  # the tables hold views, which do not move
        call.follow()
    if same and call.tables is not None and call.flag_bits == flag_bits and (backend.CHECKS_NATIVELY or (
            call.signature.matches(call.held, *LAYOUT)
            and all(map(operator.is_, map(operator.attrgetter("layout"), grad), repeat(torch.strided)))
            and call.grads_signature.matches(grad, SHAPE, DTYPE, DEVICE) and call.tables.fit(grad))) \
            and call.tables.launch(spec, grad, scalars, flags, stochastic, per_tensor_calls):
        return
    if prepared and same and call.moved():  # the tables' own check found it
        call.follow()
    if not same:  # a call of the op's own, kept unless it is a prepared call's copies (new at every call)
        kept = not prepared
        call = OpCall(param, holders, layout, *_read_states(op, spec, len(param), holders, layout))
        if kept:
            _OP_CACHE.keep((spec.name, id(layout)), call)
    tensors = {"param": param, "grad": grad} | {role: ts for role, ts in call.tensors.items() if role != "param"}
    absmax = {role: ts for role, ts in call.absmax.items() if any(t is not None for t in ts)}
    _check_op_grads(op, param, grad)
    _check_op_states(op, spec, flags, tensors, absmax)
    _, taken_formats, left, reason = _split(tensors, spec, backend)
    if left:
        raise RuntimeError(f"{op}: the {backend.NAME} kernel cannot take a tensor: {reason}")
    call.build(spec, backend, flag_bits, tensors, absmax, taken_formats)
    if not call.tables.launch(spec, grad, scalars, flags, stochastic, per_tensor_calls):
        raise RuntimeError(f"{op}: the fused kernel refused tables built from its arguments just now")
