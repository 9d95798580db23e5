"""The fused kernels as torch custom ops (``fastoptim::<spec>_step``), which torch.compile keeps as
one opaque call per bucket: their definition, the states and layout arguments that carry a bucket's
states as a few holders (:func:`op_states`), the split of a traced step's bucket decided before
tracing (:func:`split`), and the op's eager implementation, which checks its arguments and launches
the tables it keeps for them."""
import operator
import weakref
from itertools import repeat
from typing import NamedTuple

import torch

from ..multi_tensor import disjoint, pick
from ..specs import ABSMAX
from ..states import blockwise8, formats, master
from ..step_cache import DEVICE, DTYPE, LAYOUT, SHAPE, STRIDES, Signature
from . import backends
from .tables import Tables, split_taken

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
    """The roles a step op's ``states`` and ``layout`` carry, in their order: the spec's states, bf16
    params' master remainders, then the states' block maxima."""
    return (*spec.states, master.KEY, *(role + ABSMAX for role in spec.states))


def op_states(tensors, absmax, spec):
    """The ``states`` and ``layout`` arguments of ``spec``'s step op for ``tensors`` (role to one
    tensor per param) and ``absmax`` (role to each param's block maxima, None for none). Each state
    is held by its root tensor (a flat buffer holds many); ``layout`` is an int64 tensor of records,
    for each state role in ``spec.states`` order, then each role's block maxima, one per param:
    -1 where there is none, else the holder's index, the storage offset, the dimensions, the sizes
    and the strides."""
    n, holders, index, records = len(tensors["param"]), [], {}, []
    for name in _state_names(spec):
        values = absmax.get(name.removesuffix(ABSMAX)) if name.endswith(ABSMAX) else tensors.get(name)
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
        raise ValueError(f"{op}: states and layout must be what fastoptim.engines.step_op.op_states makes of "
                         f"{n} params' states ({error or 'the layout ends early or late'})") from None
    tensors = {role: found[role] for role in (*spec.states, master.KEY) if any(t is not None for t in found[role])}
    absmax = {role: found[role + ABSMAX] for role in spec.states if any(t is not None for t in found[role + ABSMAX])}
    if any(t is None for ts in tensors.values() for t in ts):
        raise ValueError(f"{op}: a state role must hold one tensor per param (or none, for a role the step "
                         "does not keep)")
    return tensors, absmax


class TracedSplit(NamedTuple):
    """A traced step's split of a bucket, decided before tracing (``split``): the indices the kernel
    takes, those left to the foreach engine and why, and the op's call over the taken tensors (None
    where it takes none), which the split holds: the op finds it while it lives."""
    taken: list
    left: list
    reason: str | None
    call: "PreparedCall | None" = None


def split(tensors, absmax, spec, originals=None, remake=None, viewed=None, counts=None):
    """A traced step's :class:`TracedSplit` of one bucket (``tensors``: role to one tensor per param,
    grads included; ``absmax``: role to each param's block maxima or None). The op's call over the
    taken tensors is prepared here, eagerly, on the user's own state tensors (``originals``, of
    which ``tensors`` may be views: a subset-norm param's; ``viewed``: those, by role, where they
    are), and ``remake(taken)`` makes the taken tensors' (tensors, absmax, viewed) afresh from them
    (see :class:`PreparedCall`). ``counts``: per param, its count and the tensor the graph reads it
    from (``StepCounts.watched``), or None."""
    taken, _, left, reason = split_taken(tensors, absmax, spec, backends.for_device(tensors["param"][0].device))
    # a graph cannot hand an op that mutates it a view of a tensor of another dtype: a complex param's real view
    complex_views = {i for i in taken for role, values in tensors.items() if role != "grad"
                     if values[i] is not None and values[i]._base is not None and values[i]._base.dtype != values[i].dtype}
    if complex_views:
        taken, left = [i for i in taken if i not in complex_views], sorted([*left, *complex_views])
        reason = reason or "a compiled step's kernels take no complex params (their real views)"
    if not taken:
        return TracedSplit(taken, left, reason)
    states, absmax = pick(tensors, taken, leave=("grad",)), pick(absmax, taken)
    holders, layout = op_states(states, absmax, spec)
    call = PreparedCall(states["param"], holders, layout, states, absmax, originals, lambda: remake(taken),
                        viewed and pick(viewed, taken), counts and [counts[i] for i in taken])
    _hold_call(spec.name, layout, call)
    return TracedSplit(taken, left, reason, call)


class OpCall:
    """A step op's call as its tables were built for: its params and state holders, the states by
    role, and the tables (with, for a backend that does not check natively, the held tensors' and the
    grads' signatures); the layout tensor it was made for holds it (see :func:`_hold_call`). ``viewed``:
    by role, the tensors that its states are views of, which the tables hold and check in their place
    (or None)."""

    viewed = counts = None

    def __init__(self, params, holders, tensors, absmax):
        self.params, self.holders, self.tensors, self.absmax = params, holders, tensors, absmax
        self.flag_bits = self.tables = self.held = self.signature = self.grads_signature = None

    def build(self, spec, backend, flag_bits, tensors, absmax, taken_formats):
        """Bind the tables of ``tensors`` (role to one tensor per param, grads included) and
        ``absmax``, checked for ``flag_bits`` (flags decide the roles a kernel reads)."""
        self.held = [t for role, ts in tensors.items() if role != "grad" for t in ts] + [
            t for ts in absmax.values() for t in ts if t is not None]
        self.flag_bits, self.signature, self.grads_signature = flag_bits, Signature((), self.held), Signature(
            (), tensors["param"])
        self.tables = Tables(tensors, absmax, spec, backend, taken_formats, watched=self.counts, originals=self.viewed)


class PreparedCall(OpCall):
    """A call that ``split`` prepared before tracing, on the user's own state tensors, with the
    ``layout`` the traced step hands the op: kept by the optimizer's plan (so it goes with the
    optimizer), found by the op through that layout, which holds it weakly.
    A state given new storage in place (``set_``, ``.data =``) is seen by the data pointers of
    ``originals`` (the user's tensors, of which the states may be views: ``viewed`` by role, which
    the tables hold, so a backend that checks natively sees them move) and the call is made afresh
    from them (``remake``), so the kernel updates the state where it now lives. The params' ``counts``
    (per param, its count and the tensor the graph reads it from: its slot in one tensor), which the
    tables check too, cannot be followed: one given new storage in place is refused."""

    siblings = ()  # weak references to the other calls of its step (see fastoptim.optimizers.step_path)

    def __init__(self, params, holders, layout, tensors, absmax, originals, remake, viewed=None, counts=None):
        super().__init__(params, holders, tensors, absmax)
        self.layout, self.originals, self.remake, self.viewed, self.counts = layout, originals, remake, viewed, counts
        self.seen = Signature(originals)
        self.counts_seen = counts and Signature([t for pair in counts for t in pair])
        mine = set(map(id, originals))  # else the states are views of them (a subset-norm or complex state's)
        states = [t for role, ts in (*tensors.items(), *absmax.items()) if role != "param" for t in ts]
        self.views = not all(id(t) in mine for t in states if t is not None)

    def checked_here(self, backend):
        """Whether Python compares the user's tensors at every call: where the states are views of them
        that the tables do not hold in their place (``viewed`` names none, as of a complex state's real
        view), or the backend checks nothing natively. Views do not move with what they view."""
        return self.views and (self.viewed is None or not backend.CHECKS_NATIVELY)

    def counts_moved(self):
        """Whether a count has moved, or changed its layout in place, since the call was made."""
        return self.counts is not None and not self.counts_seen.matches([t for pair in self.counts for t in pair],
                                                                        *LAYOUT)

    def moved(self):
        """Whether one of the user's state tensors or counts has moved, or changed its sizes, strides or
        dtype in place (t_, resize_, as_strided_), since the call was made."""
        return not self.seen.matches(self.originals, *LAYOUT) or self.counts_moved()

    def refuse(self, op, copies):
        """Raise where the step must not run on this call: a state whose sizes, strides or dtype changed
        in place (the graph was traced for the old; a step traces again on a state assigned in the
        state dict), a count given new storage (which the graph reads where it was), or, where the
        backend hands the ops copies of the tensors (``copies``), a state given new storage (the
        copies' updates would not reach it)."""
        if self.counts_moved():
            raise RuntimeError(f"{op}: a step count was given new storage in place (.data =, set_()) after the "
                               "step was compiled, and the graph reads it where it was: assign the new count in "
                               "the state dict instead (optimizer.state[param]['step'] = tensor), which traces "
                               "the step again, or write it in place (fill_)")
        if copies and not self.seen.matches(self.originals, *LAYOUT):
            raise RuntimeError(f"{op}: a state was given new storage or a new layout in place (set_, .data =, "
                               "share_memory_(), t_(), resize_()) after the step was compiled, and this backend "
                               "hands the op copies of its tensors: assign the new tensor in the state dict instead "
                               "(optimizer.state[param][key] = tensor), which traces the step again")
        if not self.seen.matches(self.originals, SHAPE, STRIDES, DTYPE):
            raise RuntimeError(f"{op}: a state was given a new layout in place (t_(), resize_(), as_strided_()) "
                               "after the step was compiled: assign the new tensor in the state dict instead "
                               "(optimizer.state[param][key] = tensor), which traces the step again")

    def follow(self, op):
        """The call made afresh from the user's tensors where they now are, unless it must refuse the
        step (see :meth:`refuse`)."""
        self.refuse(op, copies=False)
        self.tensors, self.absmax, self.viewed = self.remake()
        self.seen = Signature(self.originals)
        self.tables = None


# the attribute by which a step op's layout tensor (made for one call: see op_states) holds its call
CALL_ATTRIBUTE = "_fastoptim_step_call"


class _HeldCall:
    """A layout's call for ``spec_name``'s op: weakly one that ``split`` prepared (the optimizer's plan
    holds it, and it holds its layout), strongly one the op made for a caller that prepared none (it
    holds no layout, and goes with it). A pickled or deep-copied layout holds none: native tables do not
    travel, and its op makes a call of its own."""

    __slots__ = ("spec_name", "_call", "_weak")

    def __init__(self, spec_name: str, call: OpCall | None = None):
        prepared = isinstance(call, PreparedCall)
        self.spec_name, self._call = spec_name, None if prepared else call
        self._weak = weakref.ref(call) if prepared else None

    def call(self) -> OpCall | None:
        return self._call if self._weak is None else self._weak()

    def __reduce__(self):
        return _HeldCall, (self.spec_name,)

    def __deepcopy__(self, memo):
        return _HeldCall(self.spec_name)


def _hold_call(spec_name: str, layout: torch.Tensor, call: OpCall) -> None:
    """Let ``layout`` hold ``call``, for ``spec_name``'s op to find at its next call (see :class:`_HeldCall`)."""
    layout.__dict__[CALL_ATTRIBUTE] = _HeldCall(spec_name, call)


def _held_call(spec_name: str, layout: torch.Tensor) -> OpCall | None:
    """The call that ``layout`` holds for ``spec_name``'s op (see :func:`_hold_call`), or None."""
    held = layout.__dict__.get(CALL_ATTRIBUTE)
    call = held.call() if held is not None and held.spec_name == spec_name else None
    return None if isinstance(call, PreparedCall) and call.layout is not layout else call  # not a copy's


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
    """Raise a ValueError if a grad is not a dense tensor of its param's shape, dtype and device, or is
    its param's own memory (the kernel would read it as it writes the param)."""
    for i, (p, g) in enumerate(zip(param, grad)):
        if g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(f"{op}: grad[{i}] must be a strided tensor of its param's shape, dtype and device "
                             f"({p.dtype} {tuple(p.shape)} on {p.device}); got {g.layout} {g.dtype} "
                             f"{tuple(g.shape)} on {g.device}")
        if g.numel() and g.data_ptr() == p.data_ptr():
            raise ValueError(f"{op}: grad[{i}] is its param's own memory (param.grad = param?): give the grad "
                             "memory of its own (.clone())")


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
    for i, (p, remainder) in enumerate(zip(param, tensors.get(master.KEY, ()))):
        if (p.dtype != torch.bfloat16 or remainder.dtype not in master.DTYPES.values() or remainder.shape != p.shape
                or remainder.device != p.device):
            raise ValueError(f"{op}: {master.KEY}[{i}] must be the int16 or int8 remainder of a bf16 param, of its "
                             f"shape on its device ({p.dtype} {tuple(p.shape)} on {p.device}); got "
                             f"{remainder.dtype} {tuple(remainder.shape)} on {remainder.device}")
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
    call = _held_call(spec.name, layout)
    prepared = isinstance(call, PreparedCall)
    same = call is not None and _same_tensors(param, call.params) and _same_tensors(holders, call.holders)
    if prepared:  # and the step's other calls, before this one runs (another op of the graph may run first)
        siblings = [other for other in (ref() for ref in call.siblings) if other is not None]
        if not same:
            for checked in (call, *siblings):
                checked.refuse(op, copies=True)
        elif siblings and not (all(other.tables is not None and not other.checked_here(backend) for other in siblings)
                               and backend.CHECKS_NATIVELY
                               and backend.holds([bound for other in siblings for bound in other.tables.bound()])):
            for other in siblings:
                other.refuse(op, copies=False)
    if prepared and same and call.checked_here(backend) and call.moved():
        call.follow(op)
    if same and call.tables is not None and call.flag_bits == flag_bits and (backend.CHECKS_NATIVELY or (
            call.signature.matches(call.held, *LAYOUT)
            and all(map(operator.is_, map(operator.attrgetter("layout"), grad), repeat(torch.strided)))
            and call.grads_signature.matches(grad, SHAPE, DTYPE, DEVICE) and call.tables.fit(grad))) \
            and call.tables.launch(spec, grad, scalars, flags, stochastic, per_tensor_calls):
        return
    if prepared and same and call.moved():  # the tables' own check found it
        call.follow(op)
    if not same:  # a call of the op's own, kept unless it is a prepared call's copies (new at every call)
        kept = not prepared
        call = OpCall(param, holders, *_read_states(op, spec, len(param), holders, layout))
        if kept:
            _hold_call(spec.name, layout, call)
    tensors = {"param": param, "grad": grad} | {role: ts for role, ts in call.tensors.items() if role != "param"}
    absmax = {role: ts for role, ts in call.absmax.items() if any(t is not None for t in ts)}
    _check_op_grads(op, param, grad)
    _check_op_states(op, spec, flags, tensors, absmax)
    _, taken_formats, left, reason = split_taken(tensors, absmax, spec, backend)
    if left:
        raise RuntimeError(f"{op}: the {backend.NAME} kernel cannot take a tensor: {reason}")
    call.build(spec, backend, flag_bits, tensors, absmax, taken_formats)
    if not call.tables.launch(spec, grad, scalars, flags, stochastic, per_tensor_calls):
        raise RuntimeError(f"{op}: the fused kernel refused tables built from its arguments just now")
