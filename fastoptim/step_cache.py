"""The plan store: what a step of one param group needs of its params and states (:class:`GroupWork`),
built once and reused while it passes its one rule (:meth:`GroupWork.fits` and :meth:`GroupWork.holds`,
over :class:`Signature` and :class:`Structure`), kept per optimizer in :class:`PlanStore`. Beside it,
``multi_tensor`` builds the fused kernels' pointer tables, which the work keeps per bucket."""
import operator
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import distributed
from .multi_tensor import buckets
from .specs import ABSMAX
from .states import master
from .states.subset_norm import Partition


SHAPE, STRIDES, DTYPE, DEVICE = attrgetter("shape"), Tensor.stride, attrgetter("dtype"), attrgetter("device")
LAYOUT = (Tensor.data_ptr, SHAPE, STRIDES, DTYPE, DEVICE)


def engine_view(tensor):
    """What the engines update of a param, grad or state: a DTensor's local shard, and a complex
    tensor as its real view (the real and imaginary parts as two elements, as torch.optim takes
    them), which shares its memory."""
    tensor = distributed.local(tensor)
    return torch.view_as_real(tensor) if tensor is not None and tensor.is_complex() else tensor


class Signature:
    """The cache rule, in one place. A cache built on a list of tensors (the step's work, the fused
    engines' pointer tables) stays valid while the list holds the same tensor objects, and each
    still has the same data pointer, shape, strides, dtype and device: a tensor can keep its
    identity and get new storage in place (``share_memory_()``, ``param.data = ...``, ``set_``).
    ``owners`` are the objects whose identity counts, ``tensors`` (default: the owners) those whose
    layout does: a DTensor owns its local shard."""

    def __init__(self, owners, tensors=None):
        tensors = owners if tensors is None else tensors
        self.owners, self.n = list(owners), len(tensors)
        self.values = {get: list(map(get, tensors)) for get in LAYOUT}
        self.one_device = len(set(self.values[DEVICE])) <= 1

    def matches(self, tensors, *getters):
        """Whether ``tensors`` agree with this signature in what ``getters`` read. Shapes and
        strides are compared one by one, with no lists: thousands of new tuples per step would set
        off full runs of the garbage collector, which cost several times what the checks do."""
        return all(all(map(operator.eq, map(get, tensors), self.values[get])) if get in (SHAPE, STRIDES)
                   else list(map(get, tensors)) == self.values[get] for get in getters)

    def describes(self, owners, tensors=None):
        tensors = owners if tensors is None else tensors
        return (len(owners) == len(self.owners) and len(tensors) == self.n
                and all(map(operator.is_, owners, self.owners)) and self.matches(tensors, *LAYOUT))


class _Reading(dict):
    """A copy of a param group that notes which of its options are read (``read``: key to None where the
    whole value was, else the positions read of a tuple or list option, AdamWSN's β1 of its betas): not
    its params, which a change of makes a new work (and structure) by the work's own rule."""

    def __init__(self, group):
        super().__init__(group)
        self.read = {}

    def _note(self, key):
        if key != "params":
            self.read[key] = None

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if key != "params" and isinstance(value, (tuple, list)):  # a namedtuple or a list subclass too
            self.read.setdefault(key, set())
            return _ReadItems(value, self.read, key)
        self._note(key)
        return value

    def get(self, key, default=None):
        return self[key] if super().__contains__(key) else (self._note(key), default)[1]

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)


class _ReadItems(tuple):
    """A tuple or list option as :class:`_Reading` hands it out: it notes the positions read, and the whole
    option once it is iterated, measured or compared."""

    def __new__(cls, items, read, key):
        self = super().__new__(cls, items)
        self.read, self.key, self.given = read, key, items
        return self

    def __repr__(self):  # as given (an error message may quote it)
        return repr(self.given)

    def __getitem__(self, index):
        if self.read[self.key] is not None:
            n = tuple.__len__(self)
            self.read[self.key].update(range(n)[index] if isinstance(index, slice) else (index % n,))
        return super().__getitem__(index)

    def _read_whole(self):
        self.read[self.key] = None

    def __iter__(self):
        self._read_whole()
        return super().__iter__()

    def __len__(self):
        self._read_whole()
        return super().__len__()

    def __eq__(self, other):
        self._read_whole()
        return super().__eq__(other)

    def __ne__(self, other):
        self._read_whole()
        return super().__ne__(other)

    def __hash__(self):
        self._read_whole()
        return super().__hash__()


class GroupStructure(NamedTuple):
    """What of a group's options decides its step work (``StepPath._structure``): a change of one makes
    the work anew."""
    roles: tuple  # the state roles the engines update
    engine: str  # engines.engine_name
    formats: tuple  # state_bits, master_bits and the options the algorithm's param_factors read
    sn: object
    subset_size: object
    flag_bits: int  # the kernels' flag bits of the algorithm's flags


class Structure:
    """``structure(group)`` (a :class:`GroupStructure`), with the options of ``group`` that it read and
    the objects they held: while each still holds the same object, a step knows the structure without
    computing it. ``structure`` reads options as ``group[key]``, ``group.get(key)`` or ``key in group``
    (what ``_Reading`` sees), and nothing else that changes between steps."""

    def __init__(self, structure, group):
        reading = _Reading(group)
        self.value = structure(reading)
        self.keys = list(reading.read)
        self.held = list(map(group.get, self.keys, repeat(_MISSING)))
        read = [value if positions is None else [value[i] for i in positions]
                for value, positions in zip(self.held, reading.read.values())]
        # a list option (betas) may be edited in place: its items, as they were, are compared too
        self.items = [(key, tuple(value)) for key, value in zip(self.keys, self.held) if isinstance(value, list)]
        # the options a tensor or an array holds (a β1 in a 0-d tensor, amsgrad in a 0-d array), or a sequence of
        # them: they may be written in place, and the structure is then computed again at every check
        # (of a tuple or list option, the items the structure read)
        self.writable = [key for key, value in zip(self.keys, read) if holds_any(value, WRITABLE)]

    def holds(self, structure, group):
        """Whether ``structure(group)`` is still this one."""
        if not self.writable and all(map(operator.is_, map(group.get, self.keys, repeat(_MISSING)), self.held)) and (
                not self.items or all(len(group[key]) == len(items) and all(map(operator.is_, group[key], items))
                                      for key, items in self.items)):
            return True
        now = Structure(structure, group)
        if now.value != self.value:
            return False
        # options that changed and left it as it was (a scheduled beta)
        self.keys, self.held, self.items, self.writable = now.keys, now.held, now.items, now.writable
        return True


_MISSING = object()
WRITABLE = (Tensor, np.ndarray)  # option values that may change in place


def holds_any(value, types) -> bool:
    """Whether ``value`` is one of ``types``, or a tuple or list holding one (betas of 0-d tensors)."""
    return isinstance(value, types) or isinstance(value, (tuple, list)) and any(isinstance(v, types) for v in value)


class BucketPlan:
    """One bucket of a group's work: its params' positions among the group's (``indices``), the process
    group it reduces over (``reduce``: None for none), and what the engines made of it, kept with it (and
    made anew with the work's buckets when the states change): the fused kernel's tables and what it leaves
    to foreach
    (``kernel_split``: ``engines.fused.KernelSplit``), a traced step's split (``traced_split``:
    ``engines.step_op.TracedSplit``), the index of its params among the group's on the device
    (``owners``: the cut of per-param arguments), and what Muon's run keeps of it (``directions``: its
    direction buffers, ``sharded_params``: the DTensor params of a bucket whose matrices go whole to
    one owner rank, ``owner_exchange``: the plan of that exchange, ``distributed.OwnerExchange``)."""

    def __init__(self, indices=None, reduce=None):
        self.indices, self.reduce = indices, reduce
        self.kernel_split = self.traced_split = self.owners = None
        self.directions = self.sharded_params = self.owner_exchange = None


class GroupWork:
    """What a step of one group needs of its params that have grads: the params, their (device,
    dtype) buckets (``buckets``: :class:`BucketPlan`, each with what the engines made of it), their states
    and state tensors by role and what ``_prepare_states`` made of the states (``context``).

    It is reused while the params and their states pass :class:`Signature`'s rule: the same params
    have grads, the params' state dicts hold the very tensors it was built on under every key (a
    user may clear or replace them between steps), and none of them has moved to new storage or
    changed its layout. Checking that is most of what a step costs in Python. The gradients are
    never kept: they are checked and listed afresh every step.
    """

    def __init__(self, structure, params, local_params, signature=None, versions=None, count=None):
        self.structure, self.params, self.signature = structure, params, signature
        self.count = count  # group.get("step") when made: official Adan's count, which its tables read
        self.roles, self.engine = structure.value.roles, structure.value.engine
        self.versions = versions  # of the params that keep master remainders (states.master.Versions), or None
        self.local_params = local_params  # what the engines update: the params, or their engine_view
        self.viewed_states = local_params is not params  # the states' engine_view differs from them
        # the per-tensor scalars (step sizes, bias corrections): float64 where a param's math is float64
        self.scalar_dtype = torch.float64 if any(p.dtype == torch.float64 for p in local_params) else torch.float32
        self.buckets = list(map(BucketPlan, buckets(params)))
        self.states = self.state_values = self.tensors = self.context = self.state_signature = None
        self.watched = self.originals = None  # see read_tensors
        self.seen = None  # the OptimizerState that held the states, and its change count then: see holds
        self.traced_scalars = None  # for a traced CPU step whose scalars an op computes: scalars.TracedScalars
        self.traced_reads = None  # for a traced step: its params' first-read marks (see PlanStore.first_reads)

    def fits(self, structure, group, params, local_params=None):
        """The work's rule, over ``group``'s ``params`` that have grads now: the same param objects, the
        group's count the same object (official Adan's ``group["step"]``, which the work's tables read and
        advance: one set anew makes a new work), and ``structure(group)`` still its :class:`Structure`'s;
        with ``local_params`` (what the engines update of them), each in the same layout too (see
        :class:`Signature`): a bound step leaves that to native code, which checks every tensor it binds
        at each call. (The states: :meth:`holds`.)"""
        if local_params is None:
            same = len(params) == len(self.params) and all(map(operator.is_, params, self.params))
        else:
            same = self.signature.describes(params, local_params)
        return same and group.get("step") is self.count and self.structure.holds(structure, group)

    def holds(self, state, natively_checked=False, by_count=False):
        """Whether ``state`` (the optimizer's: param to state dict) holds the states this work was built
        on: the same state dicts, holding the same tensors under every key, each where and as it was. Where
        native code checks every tensor it binds, and the params' counts (``natively_checked``), it is left
        their layouts; ``by_count`` (a bound step's, natively checked), an ``OptimizerState`` that counted no
        change since this work last found its states there holds them (a checked step compares each). A
        param's count on the host written in place to no whole number >= 0 makes them not held: the checked
        step then checks each state, which refuses it by name (a bound step's native call reads the counts)."""
        if by_count and self.seen is not None and self.seen[0] is state and self.seen[1] == state.changes:
            return True
        states = list(map(state.get, self.params))
        if not (self.states is not None and all(map(operator.is_, states, self.states))
                and all(all(map(operator.is_, map(dict.get, states, repeat(key)), tensors))
                        for key, tensors in self.state_values.items())):
            return False
        if natively_checked:  # the params' counts are read: one written in place to no whole number is refused
            if not self.context.counts.whole():
                return False
            self.seen = state, state.changes
            return True
        return (self.state_signature.matches(self._local_states(), *LAYOUT) and self.context.counts.in_place()
                and self.context.counts.whole())

    def _local_states(self):
        """The state tensors this work was built on, as the engines see them (their ``engine_view``)."""
        return list(map(engine_view, self.state_owners)) if self.viewed_states else self.state_owners

    def use_states(self, states, context, partitions, reduced_roles, group, whole_tensors=False):
        """Take the states (every role present), with the subset-norm partition of each param (None:
        dense): the tensors of a partitioned param are handed to the engines in its (a, b, c) view.
        Params whose subsets span FSDP2 shards, and every DTensor param of math that needs each
        tensor whole (``whole_tensors``: Muon's), get buckets of their own, which communicate over ``group``."""
        self.states, self.context, self.seen = states, context, None
        keys = {key for state in states for key in state}
        self.state_values = {key: list(map(dict.get, states, repeat(key))) for key in keys}
        self.state_owners = [t for tensors in self.state_values.values() for t in tensors if isinstance(t, Tensor)]
        self.state_signature = Signature(self.state_owners, self._local_states())
        self.partitions, self.reduced_roles = partitions if any(partitions) else None, reduced_roles
        self.read_tensors()
        spanning = {i for i, (param, part) in enumerate(zip(self.params, partitions))
                    if part is not None and distributed.spans_shards(param, part)
                    or whole_tensors and distributed.is_dtensor(param)}
        self.buckets = [BucketPlan(part, reduce) for bucket in buckets(self.params)
                        for part, reduce in (([i for i in bucket if i not in spanning], None),
                                             ([i for i in bucket if i in spanning], group)) if part]

    def read_tensors(self):
        """The tensors by role from the kept states, and the block maxima of the 8-bit ones."""
        self.tensors = {"param": self.local_params} | {role: list(map(engine_view, self.state_values[role]))
                                                       for role in self.roles if role in self.state_values}
        self.absmax = {role: self.state_values[role + ABSMAX] for role in self.roles if role + ABSMAX in self.state_values}
        # what native code checks beside the tensors it binds, so that a step that checks none in Python
        # (BoundStep) still sees them change: each param's count, with the one tensor it is a slot of
        self.watched, self.originals = self.context.counts.watched(), None
        if self.partitions:  # native code binds the tensors themselves, the engines their (a, b, c) views
            self.originals = self.tensors
            self.tensors = {role: [t if part is None or t is None else part.view_state(t) if role in self.reduced_roles
                                   else part.view_param(t) for t, part in zip(tensors, self.partitions)]
                            for role, tensors in self.tensors.items()}

    def traced(self, params, local_params):
        """This work, prepared by the optimizer's ``_init_group``, for a step that torch.compile traces:
        its decisions (engine, buckets, partitions, caches) and states over ``params``, which a
        compiled step reads afresh on every call. The state tensors are this work's lists, untouched:
        a traced step that looked at each would make it an input of the graph."""
        work = GroupWork(self.structure, params, local_params, count=self.count)
        if not params:  # no grads in the group this step: nothing to update
            return work
        work.states, work.context = self.states, self.context
        work.state_values, work.traced_scalars = self.state_values, self.traced_scalars
        work.traced_reads = self.traced_reads
        work.partitions, work.reduced_roles, work.buckets = self.partitions, self.reduced_roles, self.buckets
        work.tensors = self.tensors | {"param": work.viewed(local_params, Partition.view_param)}  # in its view
        work.absmax = self.absmax
        return work

    def viewed(self, tensors, view=Partition.view_grad):
        """This step's grads (or, with ``view`` ``Partition.view_param``, params), in their params' views."""
        if self.partitions is None:
            return tensors
        return [t if part is None else view(part, t) for t, part in zip(tensors, self.partitions)]


GRADS_PATTERNS_KEPT = 8  # torch.compile's recompile limit: a step traced for more patterns recompiles anyway


class PlanStore:
    """An optimizer's step plans, in one place, with their one validity rule (:meth:`GroupWork.fits`,
    over :class:`Signature` and :class:`Structure`, then :meth:`GroupWork.holds` for the states): a work
    whose params or options no longer fit what the user wrote is replaced by a new one; one whose states
    do not takes them again. The bound step holds each group's work and checks it by the same rule.

    ``current``: each group's work in use, by key (the group's index, or a released bucket's key);
    ``patterns``: the work of each pattern of grads seen per key, kept up to ``GRADS_PATTERNS_KEPT``
    (a model whose frozen parts alternate, a GAN's, comes back to one, and a compiled step to the
    graph it traced for it); ``bound``: the bound step planned from the last checked step
    (``bound_step.BoundStep``), or None; ``released``: per released bucket's key, the bound step
    planned from its last checked step, or None; ``traced_states``: per pattern of grads of every group (the
    graph a compiled step traced for it), the state dict and its change count that its eager part
    found (one per pattern: a value that another graph's tracing rewrote would pass this one's
    guard); ``writes``: the notes of the params' version counters after the optimizer's own writes
    (``states.master.Writes``), or None; ``reads``: per group key, the first-read marks of its params
    that every graph of a compiled step reads and writes (see :meth:`first_reads`); ``forcing``: the
    fused backend that ``FASTOPTIM_FUSED_BACKEND`` named when the works were made (see
    :meth:`follow_forcing`)."""

    def __init__(self):
        self.current, self.patterns, self.released = {}, {}, {}
        self.traced_states, self.reads = {}, {}
        self.bound = self.writes = self.forcing = None

    def follow_forcing(self, forcing):
        """Drop every work and the bound steps where ``forcing`` (the fused backend that
        ``FASTOPTIM_FUSED_BACKEND`` names now, or None) is not what they were made under: their tables
        are that backend's. The notes of the params' writes stay: they are the params', not the plans'."""
        if forcing != self.forcing:
            self.forcing = forcing
            self.current.clear()
            self.patterns.clear()
            self.released.clear()
            self.bound = None

    def first_reads(self, key, group_params, params, created):
        """A traced step's first-read marks of ``params`` (those of group ``key`` with grads): one fp32
        tensor over the group's params (``group_params``), 0 where a param's optional states were made
        and no counted step has read them yet, which every graph of the group reads and marks (each
        graph would keep its own marks stale: a step that another pattern of grads counted), and the
        positions of ``params`` in it; None where all of them are read. ``created``: per param, whether
        this trace made its optional states."""
        ids = tuple(map(id, group_params))
        held = self.reads.get(key)
        if held is None or held[0] != ids:  # the group's params changed: their marks carried over
            before = {} if held is None else dict(zip(held[0], held[1].tolist()))
            held = self.reads[key] = ids, torch.tensor([before.get(i, 1.0) for i in ids], device=params[0].device)
        marks, position = held[1], {i: at for at, i in enumerate(ids)}
        positions = [position[id(param)] for param in params]
        for at, made in zip(positions, created):
            if made:
                marks[at] = 0.0
        return (marks, positions) if unread((marks, positions)) else None

    def work(self, key, pattern, structure, group, params, local_params, held_natively, check_params):
        """The :class:`GroupWork` of key ``key`` over ``group``'s ``params`` that have grads (``local_params``:
        what the engines update of them), at positions ``pattern`` of the group's, under ``structure(group)``
        (``StepPath._structure``): the one in use, or the one kept for that pattern, where it fits, else a
        new one; and what native code found of the one in use (``held_natively(work)``, one check of them all):
        None where a tensor it holds is not where and as it was, else whether this step's grads fit. A work
        whose tensors native code found needs no layout compared in Python, here or by :meth:`GroupWork.holds`.
        A work not in use takes ``params`` only once
        ``check_params(params)`` has not raised for them (a param listed twice, in another group, or given
        new storage since it was added): one kept before its check would pass the next step unchecked."""
        entry = self.current.get(key)
        if entry is not None:
            held = held_natively(entry)
            if entry.fits(structure, group, params, None if held is not None else local_params):
                return entry, held
        check_params(params)
        seen = (key, pattern)
        entry = self.patterns.get(seen)
        if entry is None or not entry.fits(structure, group, params, local_params):
            shape = Structure(structure, group)  # before any is dropped: an option may be invalid
            mine = [other for other in self.patterns if other[0] == key]  # a key's own: all are in one step
            if seen not in self.patterns and len(mine) >= GRADS_PATTERNS_KEPT:
                for other in mine:
                    del self.patterns[other]
            versions = master.Versions(params) if master.KEY in shape.value.roles else None
            entry = self.patterns[seen] = GroupWork(shape, params, local_params, Signature(params, local_params),
                                                    versions, group.get("step"))
        self.current[key] = entry
        return entry, None


def unread(reads: tuple) -> bool:
    """Whether a param of ``reads`` (a group's first-read marks and these params' positions in them: see
    :meth:`PlanStore.first_reads`) has optional states that no counted step has read yet."""
    marks, positions = reads
    values = marks.tolist()
    return any(values[at] == 0 for at in positions)
