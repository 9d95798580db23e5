"""The bound step: a step whose every group runs on tables bound to native code, which checks every
param, state and grad at each call, so that Python checks none. It is planned once, from a checked step
(:meth:`BoundStep.of`), and holds what each step would otherwise work out again: per group its
algorithm, and per bucket the tables and the grads each takes. Each step then reads the grads, checks
what native code cannot see (the rule of :meth:`BoundStep.work`), takes each group's numbers and runs
every table in one native call, which computes the step's scalars, clips and counts (see the backends'
``STEP_SCALARS``)."""
import operator
import os
from itertools import repeat
from numbers import Real
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import engines, flat_params
from .engines.backends import FORCING_VARIABLE
from .multi_tensor import bump_versions
from .optimizer_state import OptimizerState
from .specs import COMMON_SCALARS, STOCHASTIC_ROUNDING
from .step_cache import unread

# where a table's first scalars go, in the order every kernel declares them (its rule computes the rest)
FOUND_INF, SEED, GRAD_SCALE = map(COMMON_SCALARS.index, ("found_inf", "seed", "grad_scale"))


class BoundGroup(NamedTuple):
    """One group's part of a :class:`BoundStep`: what its steps would otherwise work out again."""
    group: dict
    entry: object  # its GroupWork
    algorithm: object  # its Algorithm
    # the work's buckets, whose plans hold the tables bound here: a work that takes its states again (a
    # compiled step's preparation may) makes new ones
    buckets: list
    runs: list  # per bucket: (its tables.Tables, its params' indices or None for all, its BucketPlan)
    parts: list | None  # its buckets' bound parts (see Algorithm.bound_part), or None
    positions: list  # per bucket, per table, the positions of the group's grads it takes (None: all)
    single: bool  # the single-tensor fused engine: each table runs once per tensor
    flag_bits: int  # its kernels' flag bits but stochastic rounding's (its work's structure holds them)
    # of a group of bound parts, whose tables pair no grad with its param: its params' data pointers then (-1
    # for an empty one), which no grad may have (native code refuses a moved param); else None
    param_pointers: list | None
    # the positions of the grads its parts take in fp32 (BoundMomentum.widen), which the step converts: each must
    # be of its param's dtype and contiguous, as native code would find a grad its tables take as it is (the copy
    # hides both)
    widened: list


class BoundStep:
    """A step whose every group runs on tables bound to native code (a backend that
    ``CHECKS_NATIVELY``), whose calls check every param, state and grad, so the step checks none in
    Python. Python checks what native code cannot see: that the same groups hold the same params with
    grads, under the same options and with the same states (each group's work's rule, ``GroupWork.fits``
    and ``GroupWork.holds``, less the layouts: a state dict that counted no change holds its states).
    Native code also checks what the tensors it takes derive from: the params' counts, slots of one
    tensor (``GroupWork.watched``); of a subset-norm param it holds the user's param and states in place
    of the views the engines take. ``groups``: per group, its :class:`BoundGroup`."""

    def __init__(self, groups, counts, backend, whole_step=True):
        self.groups = groups
        self.param_groups = [bound.group for bound in groups]  # what the optimizer's must still be, one by one
        self.whole_step = whole_step  # False: a released bucket's, whose groups' counts advance at step()
        self.backend = backend  # the one backend whose native call runs every table
        # the native call of every table (in the order of the groups, their buckets and tables), where the
        # backend computes the step's scalars (clip, the rules') and advances the counts natively
        self.call = None
        if backend.STEP_SCALARS:
            tables, per_tensor, ruled = [], [], []
            for bound in groups:
                for bucket_tables, _, _ in bound.runs:
                    for _, _, table, _ in bucket_tables.tables:
                        tables.append(table)
                        per_tensor.append(bound.single)
                        ruled.append(bound.parts is None)
            self.call = backend.StepCall(tables, per_tensor, ruled, norm_order=norm_order(groups))
        self.counts = counts  # those the native call advances, whose version counters a step bumps as add_ would
        self.masters = any(bound.entry.versions is not None for bound in groups)  # see FastOptimizer._restart_written

    @classmethod
    def of(cls, state, work, algorithms, whole_step=True):
        """The BoundStep of a checked step's ``work`` ((group, GroupWork, grads) per group) whose groups
        run ``algorithms`` and read and advance their step counts (``StepCounts.read``), under their
        work's structure (which holds the group's kernel flag bits); None where a group's step is not
        its bound tables' kernels alone (the algorithm runs its own way, has no kernel or no rule; a
        bucket reduces over ranks or left some tensors to foreach) or its ``bound_part`` (Muon's), its
        states are new or not all read yet (the first-read marks of a compiled step's group: native
        rules read no marks), its tensors views, or the tables are of two backends. (Two groups that
        held one count tensor hold one each since the checked step: ``check_group_count``.) Not a
        ``whole_step``: a released bucket's, whose groups' counts its caller advances at ``step()`` (it
        plans none for official Adan's group count, which a native call would advance)."""
        runs, parts = [], []
        for algorithm, (group, entry, _) in zip(algorithms, work):
            if not entry.params:
                runs.append([])
                parts.append(None)
                continue
            if (entry.states is None or entry.local_params is not entry.params or entry.viewed_states
                    or entry.context.first_reads is not None or any(plan.reduce for plan in entry.buckets)
                    or entry.traced_reads is not None and unread(entry.traced_reads)):
                return None
            if algorithm.bound_part is not None:
                found = [algorithm.bound_part(entry.tensors, plan.indices, plan, entry.engine)
                         for plan in entry.buckets]
                if None in found:
                    return None
                runs.append([(part.tables, part.positions, None) for part in found])
                parts.append(found)
                continue
            if (algorithm.run is not engines.run_bucket or algorithm.kernel_scalars is None or algorithm.rule is None
                    or not all(map(engines.fused.natively_checked, entry.buckets))):
                return None
            runs.append([(plan.kernel_split.tables, None if len(plan.indices) == len(entry.params) else plan.indices,
                          plan) for plan in entry.buckets])
            parts.append(None)
        backend = runs_backend(runs)
        if type(state) is not OptimizerState or backend is None or any(parts) and not backend.STEP_SCALARS:
            return None
        counts = [count for group, entry, _ in work if entry.params for count in entry.context.counts.read(group)]
        groups = [BoundGroup(group, entry, algorithm, entry.buckets, group_runs, group_parts,
                             [[taken(bucket, indices, index is None) for indices, index, _, _ in tables.tables]
                              for tables, bucket, _ in group_runs],
                             entry.engine == engines.fused.SINGLE, algorithm.spec.flag_bits(algorithm.flags(group)),
                             None if group_parts is None else [p.data_ptr() if p.numel() else -1 for p in entry.params],
                             [i for part in group_parts or () if part.widen for i in part.positions])
                  for algorithm, (group, entry, _), group_runs, group_parts in zip(algorithms, work, runs, parts)]
        return cls(groups, counts, backend, whole_step)

    def work(self, state, parts, structure, check, check_counted, frozen):
        """This step's (group, GroupWork, grads) per group, or None where the rule no longer holds; ``parts``:
        per group, the group and the params it steps (its ``params``, or a released bucket's);
        ``check(group, params)`` raises for what the group's options may have broken since, and
        ``check_counted(group, params)`` (the checked step's checks, its count's value among them) for a
        group whose count Python advances, which no native rule reads (official Adan's, without grads).
        A frozen param's flat grad is no grad of the step: the param is listed in ``frozen``, whose grads
        the step drops once it has run (see :func:`stepped_dropping`)."""
        if (type(state) is not OptimizerState or len(parts) != len(self.groups)
                or not all(group is bound_group for (group, _), bound_group in zip(parts, self.param_groups))):
            return None
        work = []
        for (group, params), bound in zip(parts, self.groups):
            entry = bound.entry
            if flat_params.GRAD_BUFFERS:  # a frozen flat param's grad found in the same pass (cold params)
                grads = [param.grad if param.requires_grad else flat_params.frozen_grad(param, frozen)
                         for param in params]
            else:  # each read once: a Parameter's .grad costs 50-100 ns
                grads = [param.grad for param in params]
            if not all(map(operator.is_not, grads, repeat(None))):
                params = [param for param, grad in zip(params, grads) if grad is not None]
                grads = [grad for grad in grads if grad is not None]
            check(group, params)  # before the structure is computed from what it checks
            # the work's rule (native code checks the layouts), and the tables its buckets' plans held
            if (not entry.fits(structure, group, params) or entry.params and not entry.holds(state, True, True)
                    or entry.buckets is not bound.buckets):
                return None
            if bound.param_pointers is not None:  # inline: Muon's step stays within issue 51's Python calls
                try:
                    aliased = any(map(operator.eq, map(Tensor.data_ptr, grads), bound.param_pointers))
                except RuntimeError:  # a grad with no pointer to read (a sparse one), which the checked step names
                    aliased = True
                if aliased:  # a grad that is its param's memory, which the checked step refuses
                    return None
                if bound.widened and not all(grads[i].dtype == params[i].dtype and grads[i].is_contiguous()
                                             for i in bound.widened):
                    return None  # the checked step refuses it, or takes it on foreach
            if not params and isinstance(entry.count, Tensor):
                check_counted(group, params)
            work.append((group, entry, grads))
        return work

    def step(self, optimizer, plans, parts=None):
        """A step of ``optimizer`` on these tables, in one native call that checks them all before any
        runs (and clips their grads, where asked); False, having changed nothing, where the rule of
        :meth:`work` no longer holds or that call found a tensor changed. Its groups are fused,
        elementwise and have their states: an inf step GradScaler found is skipped on the device.
        ``parts``: a released bucket's (its group and params: see :meth:`work`); None: every group's."""
        if os.environ.get(FORCING_VARIABLE) != plans.forcing:  # the tables are another backend's: the
            return False  # checked step drops them (PlanStore.follow_forcing)
        if parts is None:
            parts = [(group, group["params"]) for group in optimizer.param_groups]
        frozen = []
        work = self.work(optimizer.state, parts, optimizer._structure, optimizer._check_between_steps,
                         optimizer._check_options, frozen)
        if work is None:
            return False
        found_inf, amp_scale, max_norm = optimizer._optimizer_inputs()
        if self.call is None:
            return stepped_dropping(
                frozen, self._step_with_python_scalars(optimizer, work, plans, found_inf, amp_scale, max_norm))
        numbers = []  # every group's, before any seed is drawn: a step that goes the checked way draws its own
        rounds_after_call = False  # a group of bound parts (Muon's) rounds stochastically: it draws after the call
        for bound, (group, entry, _) in zip(self.groups, work):
            parts = bound.parts
            values = rule_numbers(group, bound.algorithm.rule[1]) if entry.params and parts is None else ()
            if any(map(isinstance, values, repeat(Tensor))):
                # a tensor lr (say), which the native rules do not take: Python computes the scalars as the
                # checked step does, as tensors, and the counts it advances, which native code then does not
                # check (see StepCounts.in_place); Muon's parts take the checked way
                return stepped_dropping(frozen, not any(bound.parts for bound in self.groups) and all(
                    entry.context.counts.in_place() for _, entry, _ in work if entry.params) and
                    self._step_with_python_scalars(optimizer, work, plans, found_inf, amp_scale, max_norm))
            if parts and found_inf is not None and bool(found_inf):
                return False  # an inf GradScaler found (a CPU tensor, read without a sync): the checked step skips
            if group["stochastic_rounding"] and entry.params:
                # a bound part's update kernel draws its seed after the call, other groups their seeds before
                # it: the checked step's order (group by group) while no such group follows a part's
                if parts:
                    rounds_after_call = True
                elif rounds_after_call:
                    return False
            if not _PLAIN.issuperset(map(type, values)) and not all(map(_a_number, values)):
                return False  # an option set to what no rule reads as a number (correct_bias=None, "0"): as checked
            numbers.append(list(map(float, values)))
        # the native call unscales (GradScaler's scale), clips and advances the counts: no tensor op here
        increment, scales, clip = optimizer._grad_scales(work, found_inf, amp_scale, max_norm, eager=True,
                                                            clip_in_step=True)
        finishing = []  # (its parts, its arguments) of each group whose parts finish after the native call
        for bound, (group, entry, _), scale in zip(self.groups, work, scales):
            if bound.parts:
                # before anything runs: what raises here (an option made invalid) must change nothing
                finishing.append((group, bound.parts, *optimizer._arguments(bound.algorithm, group, entry, scale, 1,
                                                                            traced=False)))
        # what the user wrote of a param since restarts its remainders, which a refused call puts back: the
        # checked step that follows may refuse what native code did (a count, a sparse grad), changing nothing
        restarted = []
        writes = optimizer._restart_written(work, plans, restarted) if self.masters else None
        grads_in, values, flags, options = [], [], [], []  # per table, in the call's order; the rules' options
        drawn = {}  # per device a seed is drawn on, its generator's state before (see engines.fused.rng_state)
        for (group, entry, grads), scale, bound, group_numbers in zip(work, scales, self.groups, numbers):
            buckets, parts, flag_bits = bound.positions, bound.parts, bound.flag_bits
            device = grads[0].device if grads else None
            stochastic = device is not None and group["stochastic_rounding"]  # a group without grads draws nothing
            if parts is not None:
                plain_group = optimizer._plain_group(group)
                for part, tables in zip(parts, buckets):
                    part_values, part_flags = part.launch_values(plain_group, scale, found_inf, device)
                    for positions in tables:
                        taken = [grads[i] for i in positions]
                        grads_in.append(list(map(Tensor.float, taken)) if part.widen else taken)
                        values.append(part_values)
                        flags.append(part.spec.flag_bits(part_flags))
                continue
            if stochastic:
                flag_bits |= STOCHASTIC_ROUNDING
                if device not in drawn:
                    drawn[device] = engines.fused.rng_state(device)
            for tables in buckets:  # a seed per bucket, in bucket order, as a checked step draws them
                common = [0.0] * len(COMMON_SCALARS)
                common[FOUND_INF] = 0.0 if found_inf is None else found_inf
                common[SEED] = engines.fused.draw_seed(device) if stochastic else 0
                common[GRAD_SCALE] = 1.0 if scale is None else scale
                for positions in tables:
                    grads_in.append(grads if positions is None else [grads[i] for i in positions])
                    values.append(common)
                    flags.append(flag_bits)
                    options += group_numbers
        if grads_in:
            all_grads = grads_in[0] if len(grads_in) == 1 else [grad for grads in grads_in for grad in grads]
            if self.call.run(all_grads, values, flags, options, clip, amp_scale) != self.backend.STEPPED:
                engines.fused.set_rng_states(drawn)
                put_back(restarted)
                return False
        for group, parts, args, per_tensor in finishing:  # the rest of the step of those whose kernels ran part
            for part in parts:
                part.finish(group, args, per_tensor)
        bump_versions(self.counts)  # advanced natively, as add_ would have: their version counters
        for group, entry, _ in work:
            if not entry.params and self.whole_step:  # a group's count (official Adan's), grads or not
                optimizer._count_step(group, entry, increment)
            if writes is not None and entry.versions is not None:
                writes.note(entry.versions)
        for param in frozen:  # their flat grads, once the step has run (see stepped_dropping)
            param.grad = None
        return True

    def _step_with_python_scalars(self, optimizer, work, plans, found_inf, amp_scale, max_norm):
        """:meth:`step` where Python computes the scalars, and advances the counts, as a checked step does:
        on a backend that computes no step scalars (Triton's), or for options its rules do not take."""
        check_group_counts(optimizer, work)  # which Python reads and advances here: no native rule reads them
        if not all(entry.context.counts.whole() for _, entry, _ in work if entry.params):
            return False  # a param's count written in place to no whole number: the checked step refuses it
        # the flags as planned: options read as tensors (a β1 that a tensor holds, edited in place) that would
        # set others make their work's structure another (see step_cache.Structure)
        flags = [bound.algorithm.flags(bound.group) for bound in self.groups]
        if max_norm > 0 and not all(grad.layout == torch.strided for _, _, grads in work for grad in grads):
            return False  # a sparse grad, which the checked step names: the norm would raise torch's own error
        increment, scales, _ = optimizer._grad_scales(work, found_inf, amp_scale, max_norm, eager=True)
        launches, drawn = [], {}
        for (group, entry, grads), scale, bound, group_flags in zip(work, scales, self.groups, flags):
            if not entry.params:
                continue
            algorithm, buckets, single = bound.algorithm, bound.runs, bound.single
            args, per_tensor = optimizer._arguments(algorithm, group, entry, scale, increment, traced=False)
            stochastic, device = group["stochastic_rounding"], grads[0].device
            if stochastic and device not in drawn:
                drawn[device] = engines.fused.rng_state(device)
            for tables, bucket, plan in buckets:  # a seed per bucket, in bucket order, as a checked step draws them
                ordered = engines.fused.ordered_scalars(
                    algorithm.spec, algorithm.kernel_scalars(
                        args if bucket is None else engines.args_of(args, per_tensor, bucket, device, plan)),
                    found_inf, stochastic, device)
                tables.launch(algorithm.spec, grads if bucket is None else [grads[i] for i in bucket], ordered,
                              group_flags, stochastic, single, launches)
        restarted = []
        writes = optimizer._restart_written(work, plans, restarted) if self.masters else None
        if launches and not self.backend.run_launches(launches):
            engines.fused.set_rng_states(drawn)
            put_back(restarted)
            return False
        optimizer._advance(work, increment, writes, self.whole_step)
        return True


def stepped_dropping(frozen: list, stepped: bool) -> bool:
    """``stepped``, having dropped the flat grads of the ``frozen`` params where it is True: a bound step that
    raised, or left the step to the checked way (which drops them itself), changed nothing (helper-107)."""
    if stepped:
        for param in frozen:
            param.grad = None
    return stepped


def check_group_counts(optimizer, work):
    """Raise, before anything changes, for a group's count (official Adan's) of ``work`` ((group, GroupWork,
    grads) per group) that the checked step refuses (one written in place that is no whole number >= 0),
    by ``optimizer``'s checked-step checks of the group; of a group with grads: :meth:`BoundStep.work` has
    checked the others'."""
    for group, entry, _ in work:
        if entry.params and isinstance(group.get("step"), Tensor):
            optimizer._check_options(group, entry.params)


def put_back(restarted):
    """Give each master remainder that a refused step restarted (``restarted``: (remainder, what it held)
    pairs) its values back."""
    for remainder, held in restarted:
        remainder.copy_(held)


def rule_numbers(group, keys):
    """The numbers of ``group`` that a native rule computes its scalars from (see ``Algorithm.rule``): its
    options ``keys``, in order, the betas' each (a tuple, a list or a numpy array, of the length that
    ``StepPath._check_between_steps`` checked): another option that holds a sequence is no number of a rule."""
    numbers = []
    for key in keys:
        if key == "betas":
            numbers.extend(group[key])
        else:
            numbers.append(group[key])
    return numbers


_PLAIN = frozenset((float, int, bool))  # the numbers a rule takes as they are, told apart from others at once


def _a_number(value):
    """Whether the checked step reads ``value`` as the number ``float(value)`` is: a real number (a numpy
    one, a Fraction) or a numpy bool; not a Decimal (which the checked step's float arithmetic refuses),
    a complex number, text or a sequence (whose truth is its length)."""
    return isinstance(value, Real) or isinstance(value, (np.generic, np.ndarray)) and type(value.tolist()) is bool


def norm_order(groups):
    """The order in which a bound step's native call adds its grads' squares for the clip: the tables'
    tensors (numbered in the call's order: per :class:`BoundGroup` of ``groups``, per bucket, per table,
    each table's positions in its group, None for all) in the order a checked step sums them, by group,
    then by bucket (see ``StepPath._grad_scales``); empty where that is the tables' own order. (A Muon
    bucket's tables list its matrices by shape.)"""
    rank = {(g, i): n for n, (g, i) in enumerate((g, i) for g, bound in enumerate(groups)
                                                 for plan in bound.entry.buckets for i in plan.indices)}
    keys = [rank[g, i] for g, bound in enumerate(groups) for tables in bound.positions
            for taken_positions in tables for i in (range(len(bound.entry.params)) if taken_positions is None
                                                    else taken_positions)]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [] if order == list(range(len(order))) else order


def runs_backend(runs):
    """The one backend of every table of ``runs`` (see :class:`BoundStep`), or None where there are two."""
    backends = {tables.backend for buckets in runs for tables, _, _ in buckets}
    return backends.pop() if len(backends) == 1 else None


def taken(bucket, indices, whole_table):
    """The positions in its group of the params a table takes: its ``indices`` in its ``bucket`` (None:
    the group's every param), or None where it takes them all (``whole_table``: of such a bucket)."""
    if whole_table:
        return bucket
    return indices if bucket is None else [bucket[i] for i in indices]

