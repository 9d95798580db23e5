"""The step path of every fastoptim optimizer, the half of :class:`FastOptimizer
<fastoptim.optimizers.base.FastOptimizer>` between ``step()`` and the engines: each group's step work
found in the optimizer's plan store or made (and checked), the step's scalars and counts, each bucket's
plan handed to its engine, and the traced step's preparation. Its other half (base.py) is the
torch.optim contract and the states' creation."""
import functools
import os
import weakref

import torch
from torch import Tensor

from .. import engines, flat_params
from ..bound_step import BoundStep
from ..clip import CLIP_EPS, clip_backend, clip_coefficient
from ..engines.backends import FORCING_VARIABLE
from ..multi_tensor import pick
from ..specs import ABSMAX
from ..states import master
from ..step_cache import GroupStructure, PlanStore, engine_view
from . import checks, scalars
from .algorithm import PER_GROUP, StepInputs
from .checks import check_in_one_group, check_params, check_tensor_lr, flag_value, one_value
from .step_counts import StepCounts, check_group_count, own_counts

TRACED_STATES_KEPT = 64  # patterns of grads whose traced state is kept (dynamo recompiles after 8 anyway)


def grads_pattern(params):
    """Which of ``params`` have grads: their positions."""
    return tuple(i for i, param in enumerate(params) if param.grad is not None)


def _remade(entry, bucket, taken):
    """The states and block maxima of ``entry``'s ``bucket`` (indices of its params), the ``taken``
    of them, as the engines take them, and the tensors they view (or None), made again from the state
    tensors the user sees: where a compiled step's op finds that one was given new storage in place."""
    entry.read_tensors()
    indices = [bucket[i] for i in taken]
    return (bucket_tensors(entry.tensors, indices), pick(entry.absmax, indices),
            entry.originals and pick(entry.originals, indices))


def bucket_tensors(tensors, bucket):
    """``tensors`` of the params ``bucket`` (indices), without the remainders' role where it holds none."""
    part = pick(tensors, bucket)
    return pick(part, range(len(bucket)), leave=(master.KEY,)) if master.keeps_none(part) else part


def group_lr(group):
    """The group's lr as the step reads it: a number, or a 0-d view of a one-element tensor."""
    return lr.view(()) if isinstance(lr := group["lr"], Tensor) else lr


def without_grad(function):
    """``function`` run with grad mode off, as ``@torch.no_grad()`` runs it, but for a fraction of a
    microsecond instead of several eagerly (that decorator makes a context object, and its entry and
    exit make one more each): a bound step costs tens of microseconds in all."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(enabled)
    return wrapper


class StepPath:
    """The step path of :class:`~fastoptim.optimizers.base.FastOptimizer` (see the module docstring)."""

    def _check_between_steps(self, group, params):
        """Raise if what a scheduler or the user may have set in ``group`` since the last step does not
        fit ``params`` (those with grads) or its algorithm: a tensor lr, betas other than ``n_betas`` of
        what ``checks.beta_fits`` takes (the kernels' arguments are laid out by their number, and a beta of 1
        divides by zero), and a number option that holds no number. (A ``PER_GROUP`` count set anew is
        checked by the step that plans with it, see ``_group_work``: a bound step holds its own.)"""
        betas, n_betas = group["betas"], self._algorithm(group).n_betas
        try:
            fits = len(betas) == n_betas and all(type(beta) is float and 0.0 <= beta < 1.0 or checks.beta_fits(beta)
                                                 for beta in betas)
        except (TypeError, ValueError):  # no length (a number, None, a 0-d tensor or array), or no number
            fits = False
        if not fits:
            raise ValueError(f"Invalid betas: {betas!r} (expected {n_betas} numbers in [0, 1))")
        if isinstance(group["lr"], Tensor) and params:
            check_tensor_lr(group["lr"], params[0].device)
        checks.check_numbers(group, checks.number_bounds(type(self)))  # written since: before any group steps

    def _check_options(self, group, params):
        """Raise, before any group steps, for what was written into ``group`` since the last step that a checked
        step cannot take: :meth:`_check_between_steps`, flags and arrays, and a ``PER_GROUP`` count."""
        self._check_between_steps(group, params)
        checks.plain_values(group, self.defaults)
        checks.check_bool_options(group, type(self))
        if self._algorithm(group).counts == PER_GROUP:
            check_group_count(group, self.param_groups)

    def _structure(self, group):
        """What of ``group``'s options decides its step work (a ``GroupStructure``): its state roles, engine,
        formats and kernel flags. When one changes, the work is made anew: its states checked again and
        what ``_prepare_states`` made of them made again."""
        self._check_plan(group)  # an option written between steps: checked as the constructor checks it
        algorithm = self._algorithm(group)
        engine = engines.engine_name(flag_value("foreach", group["foreach"]), flag_value("fused", group["fused"]))
        return GroupStructure(self._roles(group), engine, self._states_chosen(group), one_value("sn", group.get("sn")),
                              one_value("subset_size", group.get("subset_size")),
                              algorithm.spec.flag_bits(algorithm.flags(group)))

    def _states_chosen(self, group):
        """The options that a group's states and what ``_prepare_states`` made of them were made under: the
        states' formats (state_bits, master_bits), and those its algorithm's ``param_factors`` read."""
        return (one_value("state_bits", group["state_bits"]), one_value("master_bits", group["master_bits"]),
                *(group[key] for key in self._algorithm(group).factor_options))

    def _roles(self, group):
        """The state roles the engines update under ``group``'s options: the algorithm's, and the
        master remainders of bf16 params (a role of their own: no algorithm reads them)."""
        algorithm = self._algorithm(group)
        roles = algorithm.spec.kept(algorithm.flags(group))
        return roles + (master.KEY,) if one_value("master_bits", group["master_bits"]) > 16 else roles

    def _apply(self, work, plans, whole_step=True, traced=False):
        """Step every group of ``work`` ((group, GroupWork, grads) per group, all checked), each bucket
        on its engine, in a step that torch.compile ``traced`` or eagerly. A released bucket is not a
        ``whole_step``: the per-group counts advance once, at ``step()``."""
        found_inf, amp_scale, max_norm = self._optimizer_inputs(traced)
        eager = not traced
        writes = self._restart_written(work, plans) if eager else None  # a traced step does not look
        # Eagerly, only the fused kernels skip an inf step on the device. The other engines look at found_inf, and
        # so do a step that would create states (a new work over them draws its seeds as the bound step, helper-97)
        # and one whose math is not elementwise (Muon's kernel is half its step): a skipped step leaves no trace. A
        # traced step has its states; every engine skips in the graph but the loop engine of shard-spanning subsets.
        if found_inf is not None and any(
                entry.params and (eager and (entry.engine not in engines.FUSED
                                             or not self._algorithm(group).spec.elementwise
                                             or entry.states is None and self._creates_states(group, entry.params))
                                  or any(plan.reduce for plan in entry.buckets)) for group, entry, _ in work):
            if found_inf.item():
                return
            found_inf = None
        increment, scales, _ = self._grad_scales(work, found_inf, amp_scale, max_norm, eager)
        for key, ((group, entry, grads), scale) in enumerate(zip(work, scales)):
            if entry.params:
                self._step_group(group, entry, grads, scale, found_inf, increment, traced, key if whole_step else None)
        self._advance(work, increment, writes, whole_step, traced)

    def _restart_written(self, work, plans, undo=None):
        """Zero the master remainders of ``work``'s params written by anyone else since its steps wrote them
        (each starts again from the value written: master.Writes), but states assigned whole since; returns
        the notes (``plans.writes``), or None where none keeps remainders (a compiled step's would trace).
        ``undo``: a list that takes each remainder zeroed with a copy of what it held, for a step that
        native code may yet refuse, which puts them back (``bound_step.put_back``)."""
        writes = plans.writes
        if writes is None:
            if all(entry.versions is None or not entry.versions.params for _, entry, _ in work):
                return None
            writes = plans.writes = master.Writes()
        writes.forget_assigned(self.state.assigned)
        for _, entry, _ in work:
            if entry.versions is not None:
                self._restart_masters(writes.written(entry.versions), undo)
        return writes

    def _grad_scales(self, work, found_inf, amp_scale, max_norm, eager, clip_in_step=False):
        """What a step of ``work`` adds to the counts (1, or a tensor: 0 on a step GradScaler skipped), each
        group's grad scale (the coefficient of a clip by ``max_norm`` where it is > 0, GradScaler's 1/scale, −1 to
        maximize: see ``scalars.grad_scale``) and None; with ``clip_in_step`` (a bound step, whose native call
        clips, unscales and advances the counts itself), the increment only where a group without grads counts
        (else None), each group's −1 to maximize (or None), and what that call clips by: (max_norm, eps), or None."""
        # each rank joins the reduction, grads or not
        clipped = max_norm > 0 and (self._reduce_group is not None or any(
            plan.indices for _, entry, _ in work for plan in entry.buckets))
        # in bucket order, the order every path sums the norm in (a bound step's native call takes them itself)
        all_grads = [grads[i] for _, entry, grads in work for plan in entry.buckets for i in plan.indices
                     ] if clipped and not clip_in_step else None
        # the clip's eps: the last group's (official Adan's rule; a numpy one as its value) or torch's (FastOptimizer)
        eps = (one_value(self.clip_eps, self.param_groups[-1][self.clip_eps])
               if clipped and self.clip_eps in self.defaults and self.param_groups else CLIP_EPS)
        maximize = [group["maximize"] for group, _, _ in work]
        if clip_in_step:
            counted = not all(entry.params for _, entry, _ in work)  # official Adan's count, in Python
            return (scalars.increment_of(found_inf) if counted else None,
                    [-1.0 if m else None for m in maximize], (max_norm, eps) if clipped else None)  # grad_scale's
        if not eager and self._factors_by_op(work, all_grads if clipped else None, amp_scale, found_inf):
            return (*scalars.traced_factors(all_grads if clipped else None, max_norm, eps, amp_scale, found_inf,
                                            maximize), None)
        increment, inv_scale = scalars.increment_of(found_inf), scalars.inverse_of(amp_scale)
        clip = None
        if clipped:  # the norm's dtype from the params' (the grads have theirs: checked before any kernel runs)
            wide = torch.float64 if any(entry.scalar_dtype is torch.float64 for _, entry, _ in work) else torch.float32
            clip = clip_coefficient(all_grads, max_norm, eps, inv_scale, self._reduce_group, wide=wide,
                                    traced=not eager)
        return increment, [scalars.grad_scale(clip, inv_scale, m) for m in maximize], None

    def _advance(self, work, increment, writes, whole_step=True, traced=False):
        """After a step of ``work`` (``traced``: see ``_apply``): its counts advanced by ``increment``
        (see ``_count_step``) and, where its ``writes`` are watched, the version counters its writes
        left noted."""
        for group, entry, _ in work:
            self._count_step(group, entry, increment, whole_step, traced)
            if writes is not None and entry.versions is not None:
                writes.note(entry.versions)

    def _init_group(self):
        """The eager part of a step that torch.compile traces (dynamo runs an optimizer's ``_init_group``
        eagerly, as torch.optim's): the per-tensor Python that decides a step (checks, the states'
        creation, the fused kernel's split) runs once, untraced; the trace reads its decisions from each
        group's work (``_traced_group_work``), which dynamo's guards keep valid. Every group in one call:
        dynamo reads the state dict once, after it. The states are made even for a step GradScaler then
        skips (zeros, the count unchanged), as eagerly."""
        self._optimizer_inputs()  # a max_grad_norm written since goes into the options the graph reads
        plans = self._plans
        calls = []  # the step ops' prepared calls, each of which checks the others before it runs (see refuse)
        with flat_params.frozen_grads_dropped(self.param_groups):  # a step traced again once a param is frozen
            for group in self.param_groups:
                checks.plain_options(group, self.defaults)
            own_counts(self.state.values())
            works = [self._group_work(plans, index, group) for index, group in enumerate(self.param_groups)]
            self._check_apart([entry for entry, _ in works])
            for entry, _ in works:  # every group, before any states are made
                if entry.structure.writable:  # a graph reads no value that decides what it does
                    raise ValueError(f"Invalid {', '.join(entry.structure.writable)}: a tensor holds what decides "
                                     "the step's kernels and states (AdamWSN's β1 whether it keeps a first moment, "
                                     "AdamW's amsgrad a maximum), which a compiled step cannot follow when it is "
                                     "written in place: give it as a number")
        for index, (group, (entry, grads)) in enumerate(zip(self.param_groups, works)):
            if entry.states is None and entry.params:
                self._use_new_states(group, entry, traced=True)
            algorithm = self._algorithm(group)
            if algorithm.spec.optional and entry.params:  # the marks go to the group's, which every graph reads
                self._hand_first_reads(plans, index, group, entry)
            fused = entry.engine in engines.FUSED and entry.params and algorithm.kernel_scalars is not None
            tensors = entry.tensors | {"grad": entry.viewed(grads)} if fused else None
            for plan in entry.buckets:
                bucket = plan.indices
                if fused:
                    part = bucket_tensors(tensors, bucket)
                    absmax = pick(entry.absmax, bucket)
                    originals = [t for key, values in entry.state_values.items() for i in bucket
                                 if isinstance(t := values[i], Tensor) and (key in part or key.endswith(ABSMAX))]
                    traced = plan.traced_split = engines.step_op.split(
                        part, absmax, algorithm.spec, originals, functools.partial(_remade, entry, bucket),
                        entry.originals and pick(entry.originals, bucket),
                        entry.watched and [entry.watched[i] for i in bucket])
                    calls += [traced.call] if traced.call is not None else []
            # a CPU kernel that takes every tensor gets its scalars from an op (see scalars.py)
            kernel_takes_all = fused and algorithm.run is engines.run_bucket and all(
                plan.reduce is None and not plan.traced_split.left for plan in entry.buckets)
            entry.traced_scalars = scalars.traced_scalars(algorithm, group, self.defaults) if (
                kernel_takes_all and entry.params[0].device.type == "cpu") else None
        for call in calls:  # so that a step refused by one changes nothing, whichever op of the graph runs first
            call.siblings = [weakref.ref(other) for other in calls if other is not call]
        if len(plans.traced_states) >= TRACED_STATES_KEPT:
            plans.traced_states.clear()  # a graph whose entry went is traced again: its guard reads it
        plans.traced_states[self._grads_patterns()] = self.state, self.state.changes

    def _grads_patterns(self):
        """Which params have grads, per group: what decides the graph a compiled step traced."""
        return tuple(grads_pattern(group["params"]) for group in self.param_groups)

    def _traced_group_work(self, entry, group):
        """A traced step's work for ``group``: ``_init_group``'s decisions (``entry``) and states, over the
        params and grads the compiled step reads (and dynamo guards) at every call. The states are not
        read one by one (guards on each would cost as much as the step): the guard on the state dicts'
        change count stands for them, and native code checks their storage at every call."""
        params, local_params, grads, _ = self._with_grads(group)
        return entry.traced(params, local_params), grads

    def _with_grads(self, group, params=None):
        """The group's params (of ``params``, if given) that have grads, what the engines update of them
        (``engine_view``: DTensors' local shards, complex params' real views), their grads, viewed alike, and
        their positions among those (:func:`grads_pattern`). Each grad is read once: a Parameter's ``.grad``
        costs 50-100 ns."""
        params = list(group["params"] if params is None else params)  # a copy: the work keeps it, the user may
        grads = [param.grad for param in params]  # append to the group's list in place
        pattern = tuple(i for i, grad in enumerate(grads) if grad is not None)
        if len(pattern) < len(params):
            params, grads = [params[i] for i in pattern], [grads[i] for i in pattern]
        if not self._viewed and not any(map(Tensor.is_complex, params)):  # one appended since: viewed (helper-109)
            return params, params, grads, pattern
        return params, list(map(engine_view, params)), list(map(engine_view, grads)), pattern

    def _group_work(self, plans, index, group, some=None):
        """The group's :class:`GroupWork` (in ``plans``, the optimizer's :class:`PlanStore`) and its
        params' grads (local shards of DTensors), all checked; nothing is changed. ``some``: only these
        of its params (a released bucket), with ``index`` a key of their own."""
        params, local_params, grads, pattern = self._with_grads(group, some)
        self._check_options(group, params)
        plans.follow_forcing(os.environ.get(FORCING_VARIABLE))
        entry, held = plans.work(index, pattern, self._structure, group, params, local_params,
                                 functools.partial(engines.fused.held_natively, grads=grads),
                                 functools.partial(self._check_new_params, group))
        if not held:  # else native code found every grad fit: no check here could refuse it
            checks.check_grads(type(self).__name__, local_params, grads, entry.signature)
        if not entry.holds(self.state, held is not None):
            entry.states = None
            for param in params:
                self._check_state(param, self.state.get(param) or {}, group)
        return entry, grads

    def _check_new_params(self, group, params):
        """Raise for ``group``'s ``params`` (those with grads) that a new work may not take: a param listed
        twice, in another group too, changed in storage since added, or sharing no reductions with the others
        (a plain param or a DTensor placed otherwise among FSDP2's: helper-108), whose group is found anew."""
        check_params(params, type(self).__name__)
        check_in_one_group(group, self.param_groups, type(self).__name__)
        self._find_reduce_group()

    def _step_group(self, group, entry, grads, grad_scale, found_inf, increment, traced, key=None):
        """Step ``group``'s params with grads (``entry``: their work; ``key``: the group's in the plan store,
        None for a released bucket's step)."""
        algorithm = self._algorithm(group)
        if entry.states is None:  # every group is checked by now: states may be created
            self._use_new_states(group, entry, traced=traced)
        if not traced and key in self._plans.reads and algorithm.spec.optional:
            self._hand_first_reads(self._plans, key, group, entry)  # an eager step between compiled ones
        op_scalars = entry.traced_scalars if traced else None
        reads = entry.traced_reads  # (the group's marks, these params' positions), or None: see _hand_first_reads
        args, per_tensor = {}, ()  # where an op makes each bucket's scalars
        if op_scalars is None:
            args, per_tensor = self._arguments(algorithm, group, entry, grad_scale, increment, traced)
        else:
            counts, inputs = self._step_counts(group, entry).read(group), self._step_inputs(group, entry, grad_scale)
            if reads is not None:
                inputs = inputs._replace(first_reads=reads[0])
        fused = op_scalars is None and entry.engine in engines.FUSED and algorithm.kernel_scalars is not None
        kernel_values = algorithm.kernel_scalars(args) if fused else None  # the op's, made per bucket below
        plan = engines.Plan(entry.tensors | {"grad": entry.viewed(grads)}, algorithm.update, algorithm.spec,
                            algorithm.flags(group), args, frozenset(per_tensor), found_inf,
                            group["stochastic_rounding"], kernel_values=kernel_values,
                            warn_fallback=flag_value("fused", group["fused"]) is True, absmax=entry.absmax,
                            watched=entry.watched, originals=entry.originals, rule=(algorithm.rule or ("",))[0],
                            counts=self._step_counts(group, entry).per_param(group, len(entry.params)),
                            traced=traced)
        for bucket_plan in entry.buckets:
            bucket = bucket_plan.indices
            whole_group = len(bucket) == len(entry.params)
            part = plan if whole_group else plan.subset(bucket)
            if op_scalars is not None:
                part.kernel_values = scalars.traced_kernel_scalars(
                    algorithm, op_scalars, group, counts, increment, inputs, found_inf, group["stochastic_rounding"],
                    entry.tensors["param"][0].device, len(entry.params), [] if whole_group else bucket,
                    [] if reads is None else reads[1])
            if master.keeps_none(part.tensors):
                part = part.without(master.KEY)
            part.bucket = bucket_plan
            algorithm.run(entry.engine, part, bucket_plan.reduce)
        if reads is not None:  # a compiled step reads them again on every call, and a step that counts gave
            scalars.traced_mark_read(reads[0], increment, reads[1])  # every param its optional states
        if entry.context.first_reads is not None:  # for one eager step: then every param has its optional states
            entry.context = entry.context._replace(first_reads=None)

    def _arguments(self, algorithm, group, entry, grad_scale, increment, traced):
        """``algorithm``'s arguments for this step of ``group`` (``entry``: its work) and the names of those
        that hold one value per param (see ``scalars.step_arguments``). Options written as numpy values are
        read as their Python values (``checks.plain_values``), as the native rules and a compiled step read
        them; the group keeps what was written."""
        options, counts = self._plain_group(group), self._step_counts(group, entry).read(group)
        return scalars.step_arguments(algorithm, options, scalars.one_count(counts), increment,
                                      self._step_inputs(options, entry, grad_scale), traced)

    def _plain_group(self, group):
        """``group``, or a copy with its numpy options as their Python values (``checks.plain_values``)."""
        plain = checks.plain_values(group, self.defaults)
        return {**group, **plain} if plain else group

    def _step_counts(self, group, entry):
        """The :class:`StepCounts` of ``group``'s params with grads (``entry``: their work, or None)."""
        return entry.context.counts if entry is not None and entry.context is not None else StepCounts(
            self._algorithm(group).counts)

    @staticmethod
    def _hand_first_reads(plans, key, group, entry):
        """Hand the first reads of ``entry``'s params (its context's: 0 where its states were made and not
        read yet) to the marks of group ``key`` in ``plans`` (see ``PlanStore.first_reads``), which every
        step of the group reads and marks from then on, through ``entry.traced_reads``: each graph of a
        compiled step, and an eager step between them, of whichever pattern of grads."""
        made = entry.context.first_reads
        if made is None and entry.traced_reads is not None and plans.reads[key][1] is entry.traced_reads[0]:
            return  # it holds the group's marks, all made before: kept, read or not (a graph guards their type)
        entry.traced_reads = plans.first_reads(key, group["params"], entry.params, [
            False] * len(entry.params) if made is None else [value == 0 for value in made.tolist()])
        if made is not None:  # else the context stays the one a graph may have read
            entry.context = entry.context._replace(first_reads=None)

    def _step_inputs(self, group, entry, grad_scale):
        """The :class:`StepInputs` of this step of ``group`` but its count; its first reads are its params'
        marks among the group's where a compiled step traced them (``_hand_first_reads``)."""
        context, reads = entry.context, entry.traced_reads
        first_reads = context.first_reads if reads is None else reads[0][reads[1]]
        return StepInputs(group_lr(group), grad_scale, None, entry.scalar_dtype, first_reads, context.factors)

    def _count_step(self, group, entry, increment, whole_step=True, traced=False):
        """Advance the group's step counts by ``increment`` (see ``StepCounts.advance``) after a step of
        its params with grads (``entry``: their work; None: a released step's per-group counts alone),
        which torch.compile ``traced`` or ran eagerly: a traced CPU step whose scalars an op computed, or
        whose group had no grads, advances them through an op too."""
        by_op = traced and (entry is None or not entry.params or entry.traced_scalars is not None)
        self._step_counts(group, entry).advance(group, increment, by_op, whole_step)

    def _factors_by_op(self, work, clipped_grads, amp_scale, found_inf):
        """Whether a traced step computes its clip coefficient and GradScaler's factors through
        ``fastoptim::step_factors``: where it has some, and an op computes every group's scalars (see
        ``scalars``), and the clip's sum of squares is the CPU clip kernel's, over this rank's grads."""
        return ((clipped_grads is not None or amp_scale is not None or found_inf is not None)
                and self._reduce_group is None
                and all(entry.traced_scalars is not None for _, entry, _ in work if entry.params)
                and (clipped_grads is None or clip_backend(clipped_grads) is not None))

    @without_grad
    def _step_released(self, parts):
        """Step ``parts`` on their grads, checked as a step checks them, all before any steps: per part (a
        released bucket, or what backward left of a group), its step work's key in the plan store, its
        group's index and its params. One part steps on its bound step (``PlanStore.released``) where its
        rule holds, and plans one from its checked step. The per-group counts advance at ``step()``."""
        plans, keys, one = self._plans, {key for key, _, _ in parts}, len(parts) == 1
        plans.bound = None  # the next normal step is checked again
        bound = plans.released.pop(parts[0][0], None) if one else None
        if bound is not None and bound.step(self, plans, [(self.param_groups[i], ps) for _, i, ps in parts]):
            plans.released[parts[0][0]] = bound
            return
        work = [(self.param_groups[i], *self._group_work(plans, key, self.param_groups[i], ps)) for key, i, ps in parts]
        self._check_apart([entry for _, entry, _ in work], [e for key, e in plans.current.items() if key not in keys])
        self._apply(work, plans, whole_step=False)
        # none where it reduces (run again, it would twice), nor for a group count (native code would advance it)
        if one and self._reduce_group is None and (algorithm := self._algorithm(work[0][0])).counts != PER_GROUP:
            plans.released[parts[0][0]] = BoundStep.of(self.state, work, [algorithm], False)

    def _restart_masters(self, params, undo=None):
        """Zero the master remainders of ``params``, written by someone else since this optimizer's step
        last wrote them, each to start again from the value written (see master.Writes); ``undo``: see
        :meth:`_restart_written`."""
        for param in params:
            remainder = self.state.get(param, {}).get(master.KEY)
            if remainder is not None:
                if undo is not None:
                    undo.append((remainder, remainder.clone()))
                remainder.zero_()

    def _restart_written_masters(self):
        """:meth:`_restart_masters` of every param written since this optimizer's step last wrote it."""
        writes = self._plans.writes
        if writes is not None:
            self._restart_masters(writes.all_written())

    def _forget_plans(self):
        """Drop the step plans and pointer tables, which hold the states: for when states are replaced."""
        self._plans = PlanStore()
