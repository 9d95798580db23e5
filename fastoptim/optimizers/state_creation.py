"""How a fastoptim optimizer's states are made and checked, the half of :class:`FastOptimizer
<fastoptim.optimizers.base.FastOptimizer>` that knows their formats: each param's state with every
role its group's options keep (zeros in their format, second moments in its subset-norm partition,
new states in flat buffers), and the check that a state still fits its param."""
import functools
from typing import NamedTuple

import torch
from torch import Tensor

from .. import distributed, engines
from ..multi_tensor import FlatStates, disjoint, overlapping
from ..specs import ABSMAX
from ..states import formats, master, subset_norm
from ..step_cache import engine_view
from .algorithm import PER_PARAM
from .checks import is_step_count, one_value, overlaps_itself, step_count
from .step_counts import StepCounts, own_counts


class StateContext(NamedTuple):
    """What a group's step reads of its states besides the tensors, made when they change (see
    ``_prepare_states``): the step counts (:class:`StepCounts`), the algorithm's ``param_factors``
    and :class:`StepInputs`' ``first_reads``."""

    counts: StepCounts
    factors: Tensor | None = None
    first_reads: Tensor | None = None


def outside_inference_mode(method):
    """``method``, run outside ``torch.inference_mode()`` where a caller is in it: the states it makes (a step's,
    a load's copies) are written in place by every later step, which torch refuses for an inference tensor
    outside inference mode, midway through a loop or foreach step (helper-97). Only what makes states: a step
    under inference mode updates params that may be inference tensors, in place, which needs the mode. Without
    grad mode, as in inference mode (leaving it turns grad mode on)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)
    return wrapper


class StateCreation:
    """The states' half of :class:`~fastoptim.optimizers.base.FastOptimizer` (see the module docstring)."""

    def _check_state(self, param, state, group):
        """Raise if a state tensor no longer fits its parameter (``param.data = ...`` after the state
        was created, or an edited state): its shape, dtype and device must be what a fresh one has.
        A flattened subset-norm partition needs a contiguous param."""
        try:
            subset_norm.check_record(param.shape, state)
        except ValueError as error:
            raise RuntimeError(f"{type(self).__name__}: {error}: was the param changed after its state was "
                               "created? Clear its state with optimizer.state[param].clear()") from None
        partition = self._partition(param, state, group)
        if distributed.is_dtensor(param) and subset_norm.needs_contiguous(partition):
            distributed.check_flattened(param, partition)
        if subset_norm.needs_contiguous(partition) and not distributed.local(param).is_contiguous():
            raise ValueError(f"{type(self).__name__}: subset_size cuts a param into subsets in its row-major "
                             f"order, which needs a contiguous param; got shape {tuple(param.shape)} with strides "
                             f"{param.stride()}. Make it contiguous, or use subset_size=None (rows or columns)")
        expected = self._expected_state(group, param, state)
        for key, (shape, dtype) in expected.items():
            value = state.get(key)
            if isinstance(value, Tensor) and value.is_inference():
                raise RuntimeError(
                    f"{type(self).__name__}: state '{key}' of a param of shape {tuple(param.shape)} is an inference "
                    "tensor (made under torch.inference_mode()), which a step cannot write in place: give it a "
                    "copy made outside inference mode, or clear the param's state with optimizer.state[param].clear()")
            if key == "step" and value is not None and (not is_step_count(value, param.device)
                                                         or value.device.type == "cpu"):
                # a count set by hand (``state["step"] = 1``): _prepare_states takes it as torch takes one;
                # one that is no whole number >= 0 is refused by name, a tensor's where it is on the CPU
                # (another device's value is not read: that would wait for it)
                step_count(value, param.device, f"step of a param of shape {tuple(param.shape)}")
                continue
            if key in state and not isinstance(value, Tensor):  # None, a list, a number
                raise RuntimeError(
                    f"{type(self).__name__}: state '{key}' of a param of shape {tuple(param.shape)} is {value!r:.60}, "
                    "not a tensor: delete the key (a step makes the state anew), or clear the param's state with "
                    "optimizer.state[param].clear()")
            role = key.removesuffix(ABSMAX)
            if value is None and role != key and role in state:  # a companion is never created alone
                raise RuntimeError(
                    f"{type(self).__name__}: state '{role}' holds 8-bit codes without its block maxima '{key}': "
                    "was it deleted? Restore it, or clear the param's state with optimizer.state[param].clear()")
            if value is not None and (value.shape != shape or value.dtype != dtype or value.device != param.device):
                raise RuntimeError(
                    f"{type(self).__name__}: state '{key}' is {value.dtype} {tuple(value.shape)} on {value.device}, "
                    f"but its param ({param.dtype} {tuple(param.shape)} on {param.device}) needs {dtype} "
                    f"{tuple(shape)}: was the param (or state_bits, master_bits) changed after its state was created? "
                    "Convert the state (a state dict round trip does), or clear it with optimizer.state[param].clear()")
        if master.KEY in state and master.KEY not in expected:
            raise RuntimeError(
                f"{type(self).__name__}: state '{master.KEY}' holds a master remainder that master_bits="
                f"{group['master_bits']} does not keep for a {param.dtype} param: was master_bits changed after the "
                "state was created? Convert the state (a state dict round trip does), or clear it with "
                "optimizer.state[param].clear()")

    def _use_new_states(self, group, entry, traced):
        """Create the missing states of ``entry``'s params and hand them to it, for a ``traced`` step or
        an eager one. (The caller knows which: dynamo's own test reads False in the ``_init_group``
        that it runs at tracing before torch 2.13.)"""
        states, context = self._prepare_states(entry.params, group, traced)
        partitions = [subset_norm.from_record(p.shape, s) for p, s in zip(entry.params, states)]
        spec = self._algorithm(group).spec
        entry.use_states(states, context, partitions, spec.reduced, self._reduce_group, not spec.elementwise)

    def _partition(self, param, state, group, algorithm=None):
        """The subset-norm partition of a param under ``algorithm`` (None: its group's): the one its state
        records; for a state without a second moment yet, the group's (``sn``, ``subset_size``); None: a
        dense second moment, which a complex param always keeps (as its states, see ``formats.for_state``)."""
        if param.is_complex():
            return None
        if any(key in state for key in (*subset_norm.RECORDS, *(algorithm or self._algorithm(group)).spec.reduced)):
            return subset_norm.from_record(param.shape, state)
        return (subset_norm.from_options(param.shape, one_value("subset_size", group.get("subset_size")))
                if one_value("sn", group.get("sn")) else None)

    def _formats(self, group, param, state, algorithm=None):
        """The format of each state role of ``param`` that ``group``'s options keep under ``algorithm``
        (None: the group's; see fastoptim.states.formats), and its subset-norm partition (None: dense)."""
        algorithm = algorithm or self._algorithm(group)
        partition = self._partition(param, state, group, algorithm)
        return {role: formats.for_state(param, algorithm.spec.role(role), one_value("state_bits", group["state_bits"]),
                                   partition)
                for role in algorithm.spec.kept(algorithm.flags(group))}, partition

    def _check_apart(self, works, others=()):
        """Raise where a state that a step of ``works`` (a GroupWork per group, checked) updates shares memory
        with a param or another state, of any group or of the works ``others`` (the other released buckets'
        of a released bucket's step): see :meth:`_check_states_apart`. Only where a group takes its states
        again (``GroupWork.holds`` failed: a work whose states were not written holds them)."""
        if not all(entry.states is not None or not entry.params for entry in works):
            self._check_states_apart([param for entry in (*works, *others) for param in entry.params])

    def _check_states_apart(self, params):
        """Raise where a state of ``params`` shares memory with a param or another state of theirs
        (``state["exp_avg"] = p.detach()``, ``state["exp_avg_sq"] = state["exp_avg"]``), or with itself (an
        expanded view, whose writes would land on one element, or past its memory in a kernel): the fused kernels
        read each element of them all before they write any, the other engines in their ops' order, so such
        steps differ (torch's is its ops' order). Params that share memory with each other step as they did.
        One sort of all the spans, which the states made in flat buffers never share."""
        view = engine_view if self._viewed else None  # DTensors' or complex params' (step_cache)
        tensors, seen = [], set()  # a param of two works (a group's and a released bucket's) is listed once
        for param in params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            tensors.append((param, None, param if view is None else view(param)))
            for key, value in (self.state.get(param) or {}).items():
                if key != "step" and isinstance(value, Tensor):
                    tensors.append((param, key, value if view is None else view(value)))
                    if not value.is_contiguous() and overlaps_itself(tensors[-1][2]):
                        raise RuntimeError(f"{type(self).__name__}: state {key!r} of a param of shape "
                                           f"{tuple(param.shape)} has elements that share memory (strides "
                                           f"{value.stride()}): a step writes each, so a state must own its "
                                           "memory; clone it, or clear it with optimizer.state[param].clear()")
        spans = [tensor for _, _, tensor in tensors]
        if disjoint(spans):
            return

        def named(param, key):
            shape = f"a param of shape {tuple(param.shape)}"
            return shape if key is None else f"state {key!r} of {shape}"
        for first, second in overlapping(spans):
            (param, key, _), (other_param, other_key, _) = tensors[second], tensors[first]
            if key is None and other_key is None:
                continue
            pair = (f"{named(param, key)} and its {'param' if other_key is None else repr(other_key)}"
                    if other_param is param else f"{named(param, key)} and {named(other_param, other_key)}")
            raise RuntimeError(f"{type(self).__name__}: {pair} share memory: a step updates each, so each state "
                               "must own its memory; clone it, or clear it with optimizer.state[param].clear()")

    def _check_released_states(self, parts):
        """Raise what the steps of ``parts`` (per released bucket: its step work's key in the plan store, its
        group's index, its params) would refuse of their params' states, before backward steps any of them:
        each param's state (:meth:`_check_state`) where its bucket's work no longer fits or holds them
        (``GroupWork.fits``, ``GroupWork.holds``, with native code checking the tensors its tables hold; a count
        written in place to no whole number makes them not held), and then that no state of theirs shares memory with
        another's (:meth:`_check_states_apart`). Nothing refused, a count that
        several of them share is made each one's own (``own_counts``), as a step of their group makes it."""
        unheld = False
        for key, index, params in parts:
            entry = self._plans.current.get(key)
            # the plan's rule, as the bucket's step applies it: the same params under options that still give
            # its structure (state_bits set anew makes states of another format), and each state compared by
            # identity (a change count misses dict's own methods), the counts' values read
            if (entry is not None and entry.states is not None
                    and entry.fits(self._structure, self.param_groups[index], params)
                    and entry.holds(self.state, engines.fused.held_natively(entry) is not None)):
                continue
            unheld = True
            for param in params:
                self._check_state(param, self.state.get(param) or {}, self.param_groups[index])
        if unheld:
            params = [param for _, _, params in parts for param in params]
            self._check_states_apart(params)
            # each bucket steps alone: one that holds its plan would advance a count another param now shares
            # before that param's bucket packs it (a step of the whole group packs them all first)
            own_counts([self.state[param] for param in params if param in self.state])

    def _ensure_state(self, param, group, place=None):
        """The param's state with every role of the group present: missing ones are zeros in their
        format, second moments in the param's partition (recorded in the state when it is new), and
        a ``step`` count first where the algorithm counts per param (as torch orders its state).
        ``place(key, tensor)``: where a new state goes (its slot in a flat buffer); the states are
        then made as "meta" tensors, which ``place`` turns into their slots, zeros, then filled with
        their format's ``fill`` where it is not 0."""
        state = self.state[param]
        like = param if place is None else torch.empty_like(param, device="meta")

        def add(states, fill=lambda key: 0):
            if place is not None:
                states = {key: place(key, value) for key, value in states.items()}
                for key, value in states.items():
                    if start := fill(key):
                        value.fill_(start)
            state.update(states)
        if self._algorithm(group).counts == PER_PARAM and "step" not in state:
            add({"step": torch.zeros((), dtype=torch.float32, device=like.device)})
        states_formats, partition = self._formats(group, param, state)
        if partition is not None:
            state.update(partition.record)
        for role, state_format in states_formats.items():
            if role not in state:
                spec_role = self._algorithm(group).spec.role(role)
                add(state_format.zeros(like, spec_role, partition), functools.partial(state_format.fill, spec_role))
        master_bits = one_value("master_bits", group["master_bits"])
        if master.dtype(param, master_bits) is not None and master.KEY not in state:
            add({master.KEY: master.zeros(like, master_bits)})
        return state

    def _creates_states(self, group, params):
        """Whether a step of ``group``'s ``params`` would create a state: one that its options need is missing."""
        return any(not self._expected_state(group, param, state := self.state.get(param, {})).keys() <= state.keys()
                   for param in params)

    def _expected_state(self, group, param, state, algorithm=None):
        """The (shape, dtype) of each state tensor that a param's state must have under ``algorithm``
        (None: its group's), companions (an 8-bit state's block maxima) included."""
        algorithm = algorithm or self._algorithm(group)
        states_formats, partition = self._formats(group, param, state, algorithm)
        expected = {"step": (torch.Size([]), torch.float32)} if algorithm.counts == PER_PARAM else {}
        for role, state_format in states_formats.items():
            expected |= state_format.expected(param, algorithm.spec.role(role), partition)
        remainder = master.dtype(param, one_value("master_bits", group["master_bits"]))
        if remainder is not None:
            expected[master.KEY] = (param.shape, remainder)
        return expected

    @outside_inference_mode
    def _prepare_states(self, params, group, traced):
        """The state dicts of a group's params with grads, with missing states created, and their
        :class:`StateContext`, which ``_step_inputs`` reads. Called when they change, not every
        step. New states are made in flat buffers (``multi_tensor.FlatStates``): a fused step checks
        a buffer per key instead of a tensor per state, and per-param counts are views of one tensor,
        so a step adds to them in one op (2000 separate 0-d tensors cost milliseconds of dispatch),
        and a compiled step hands its op a few buffers; not for DTensor or complex params. A ``traced``
        step leaves per-param counts it finds apart as they are (see ``StepCounts.of_states``)."""
        algorithm, device = self._algorithm(group), params[0].device
        optional = algorithm.spec.optional  # read before the states are created
        first_reads = [float(all(role in self.state.get(param, ()) for role in optional)) for param in params
                       ] if optional else []
        if self._viewed:
            states = [self._ensure_state(param, group) for param in params]
        else:  # new states go into flat buffers, one param's at a time
            now = [self.state.get(param, {}) for param in params]
            flat = FlatStates([{key: layout for key, layout in self._expected_state(group, param, state).items()
                                if key not in state} for param, state in zip(params, now)], device)
            states = [self._ensure_state(param, group, functools.partial(flat.take, index))
                      for index, param in enumerate(params)]
        counts = StepCounts.of_states(algorithm.counts, params, states, traced)
        factors = None if algorithm.param_factors is None else torch.tensor(
            [algorithm.param_factors(group, param) for param in params], dtype=torch.float64, device=device)
        first_reads = torch.tensor(first_reads, device=device) if 0.0 in first_reads else None
        return states, StateContext(counts, factors, first_reads)
