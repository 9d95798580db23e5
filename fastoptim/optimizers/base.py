"""The contract every fastoptim optimizer keeps: torch.optim's (param groups, ``step``, state
dicts, hooks), with every input checked before anything changes, and one step path for all
algorithms. A subclass declares its algorithm (an :class:`Algorithm` record) and its options; this
class creates the states, counts the steps and runs them."""
import functools
import operator
import warnings
from itertools import repeat
from typing import NamedTuple
from operator import attrgetter

import torch
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import distributed, engines, flat_params
from ..clip import CLIP_EPS, clip_backend, clip_coefficient
from ..multi_tensor import FlatStates, bump_versions, pick
from ..specs import ABSMAX
from ..states import formats, master, subset_norm
from ..bound_step import BoundStep
from ..step_cache import DEVICE, DTYPE, SHAPE, GroupWork, OptimizerState, Signature, are_slots, engine_view
from .algorithm import PER_GROUP, PER_PARAM, Algorithm, StepInputs
from . import release, scalars
from .checks import check_hyperparameters, check_params, check_tensor_lr, is_step_count, normalize_betas, step_count
from .state_dict import StateDicts


# The arguments every fastoptim optimizer takes, described once: an optimizer's docstring puts this
# line in its Args section, and FastOptimizer.__init_subclass__ replaces it with the descriptions.
COMMON_ARGS_LINE = "        (the arguments of every fastoptim optimizer)"
COMMON_ARGS = """\
        foreach: with ``fused``, the engine: ``foreach=False, fused=False`` the loop engine (the
            reference), ``foreach=True, fused=False`` foreach, ``fused=True`` the fused kernel (one
            call per bucket, or per tensor with ``foreach=False``); both None: the fastest there is.
        fused: see ``foreach``.
        maximize: maximize the objective instead of minimizing it.
        max_grad_norm: if > 0, every gradient is scaled by ``min(1, max_grad_norm / (norm + eps))``,
            the norm taken over all groups (eps: the last group's, or torch's 1e-6 without one),
            with no host sync. Global, so set in the constructor only.
        stochastic_rounding: round updated bf16 params up or down at random, with the probability
            of their distance, instead of to nearest even.
        master_bits: for bf16 params, the bits of the fp32 value the optimizer updates: 16 (the
            param alone), 24 (an 8-bit remainder beside it in the state, ``master_remainder``) or 32
            (a 16-bit remainder: the exact fp32 master, at 2 bytes per element instead of a 4-byte
            copy), which the fused kernels read and write in their one pass. A param written in place
            by anyone else starts again from the value written. See fastoptim.states.master.
        state_bits: 32 (fp32 states), 16 (bf16) or 8 (8-bit blockwise codes beside their block
            maxima, for params of 4096+ elements). State dicts convert between formats on load.
        shard_group: the process group whose ranks each hold a partition of the model's params (as
            under ZeroRedundancyOptimizer): global reductions (the clipping norm) run over it."""

GRADS_PATTERNS_KEPT = 8  # torch.compile's recompile limit: a step traced for more patterns recompiles anyway


class StateContext(NamedTuple):
    """What a group's step reads of its states besides the tensors, made when they change (see
    ``_prepare_states``): the params' ``step`` counts as views of one tensor (``PER_PARAM``; None:
    separate tensors), the algorithm's ``param_factors`` and :class:`StepInputs`' ``first_reads``."""

    counts: Tensor | None = None
    factors: Tensor | None = None
    first_reads: Tensor | None = None


def _grads_pattern(params):
    """Which of ``params`` have grads: their positions."""
    return tuple(i for i, param in enumerate(params) if param.grad is not None)


def _remade(entry, bucket, taken):
    """The states and block maxima of ``entry``'s ``bucket`` (indices of its params), the ``taken``
    of them, as the engines take them, made again from the state tensors the user sees: where a
    compiled step's op finds that one was given new storage in place."""
    entry.read_tensors()
    indices = [bucket[i] for i in taken]
    return pick(entry.tensors, indices, leave=(master.KEY,)), pick(entry.absmax, indices)


def _keeps_no_remainders(tensors):
    """Whether a bucket's ``tensors`` (role to one tensor per param) hold the remainders' role with
    none in it: a group with master_bits keeps them for its bf16 params, and a bucket has one dtype."""
    return master.KEY in tensors and tensors[master.KEY][0] is None


def in_dtype(value, dtype):
    """A scalar of the step in ``dtype`` when it is a tensor (a Python float needs no cast)."""
    return value.to(dtype) if isinstance(value, Tensor) else value


def group_lr(group):
    """The group's lr as the step reads it: a number, or a 0-d view of a one-element tensor (which
    a scheduler may change in place)."""
    lr = group["lr"]
    return lr.view(()) if isinstance(lr, Tensor) else lr


def without_grad(function):
    """``function`` run with grad mode off, as ``@torch.no_grad()`` runs it, but for a fraction of a
    microsecond instead of several eagerly (that decorator makes a context object, and its entry and
    exit make one more each): a bound step costs tens of microseconds in all. Traced, it is
    ``torch.no_grad()``, which dynamo knows."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return function(*args, **kwargs)
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(enabled)
    return wrapper


def _run_step_hooks(step, optimizer, args, kwargs):
    """``step(*args, **kwargs)`` between the optimizer's step hooks, as torch.optim runs them (``args``
    begins with the optimizer; a pre-hook may return new (args, kwargs))."""
    for pre_hook in (*_global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()):
        result = pre_hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{step} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
            args, kwargs = result
    out = step(*args, **kwargs)
    optimizer._optimizer_step_code()
    for post_hook in (*optimizer._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
        post_hook(optimizer, args, kwargs)
    return out


class FastOptimizer(StateDicts, torch.optim.Optimizer):
    """The base of every fastoptim optimizer. A subclass gives:

    - ``algorithm``: its :class:`Algorithm` (fastoptim.optimizers.algorithm), declared beside its math;
    - ``__init__``: its signature and defaults, collected into ``defaults`` for this one's;
    - optionally ``_check_group`` (its own options), and ``_algorithm(group)`` where some groups run
      another algorithm (Muon's AdamW companions).
    """

    algorithm: Algorithm

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and COMMON_ARGS_LINE in cls.__doc__:
            cls.__doc__ = cls.__doc__.replace(COMMON_ARGS_LINE, COMMON_ARGS)
        spec = cls.__dict__["algorithm"].spec if "algorithm" in cls.__dict__ else None
        if spec is not None and spec.elementwise:  # its fused kernels' op, which torch.compile keeps
            engines.fused.define_op(spec)

    def __init__(self, params, defaults, shard_group):
        """``shard_group``: the process group whose ranks' params, together, are the model's, each
        once (ZeroRedundancyOptimizer's partition); global reductions run over it. Not a group
        option: ZeroRedundancyOptimizer consumes ``process_group``, and param groups go into state dicts.

        The hyperparameters are checked before the params, as torch.optim checks them."""
        normalize_betas(defaults)
        self._check_group(defaults, defaults["max_grad_norm"])
        distributed.check_shard_group(shard_group)
        self.shard_group = shard_group
        super().__init__(params, defaults)

    @property
    def state(self) -> OptimizerState:
        """Param to its state dict, as torch.optim's ``defaultdict(dict)``. A mapping assigned to it
        (``optimizer.state = defaultdict(dict)``, a reset of the states) is taken as an
        :class:`OptimizerState` of its entries, which counts its changes, so that every step path,
        a compiled one too, finds what is written to it."""
        return self.__dict__["state"]

    @state.setter
    def state(self, states):
        self.__dict__["state"] = states if type(states) is OptimizerState else OptimizerState(states)

    def add_param_group(self, param_group):
        params = param_group["params"]
        if not isinstance(params, (Tensor, set)):  # torch refuses a set; a generator is read once, here
            param_group["params"] = list(params)
        with warnings.catch_warnings():  # torch warns of a duplicate param, which check_params refuses
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            normalize_betas(group)
            self._check_group(group)
            check_params(group["params"], type(self).__name__)
            devices = {param.device for param in group["params"]}
            if len(devices) > 1:
                raise ValueError(f"all params of a group must be on one device, got {sorted(map(str, devices))}")
            if isinstance(group["lr"], Tensor) and devices:
                check_tensor_lr(group["lr"], devices.pop())
            if group["master_bits"] > 16 and any(param.dtype == torch.float16 for param in group["params"]):
                raise ValueError(f"Invalid master_bits: {group['master_bits']} keeps remainders of bf16 params; an "
                                 "fp16 param's bits do not split that way. Use bf16 (or fp32) params, or "
                                 "master_bits=16")
            self._find_reduce_group()
            if self._algorithm(group).counts == PER_GROUP:
                self._group_count(group)  # now, not at the first step: a compiled step must find it
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group, max_grad_norm=None):
        algorithm = self._algorithm(group)
        check_hyperparameters(group, algorithm.n_betas)
        if group.get("sn") and not algorithm.spec.reduced:
            raise ValueError(f"Invalid sn: {type(self).__name__} keeps no second moment, so sn does not apply")
        if group["max_grad_norm"] != (self.defaults["max_grad_norm"] if max_grad_norm is None else max_grad_norm):
            raise ValueError("Invalid max_grad_norm: it clips by the norm over all groups, "
                             "so set it in the constructor, not per group")
        engines.engine_name(group["foreach"], group["fused"])

    def _find_reduce_group(self):
        """The group of this optimizer's global reductions (see fastoptim.distributed), whether its
        params are DTensors, whose local shards the engines update, and whether the engines update
        another view of some params than the params (DTensors, complex params: ``engine_view``)."""
        params = [param for group in self.param_groups for param in group["params"]]
        self._reduce_group = distributed.reduction_group(params, self.shard_group)
        self._sharded = any(distributed.is_dtensor(param) for param in params)
        self._viewed = self._sharded or any(param.is_complex() for param in params)

    def __getstate__(self):  # a copy keeps shard_group, or fails loudly where a group cannot be copied
        return super().__getstate__() | {"shard_group": self.shard_group}

    def __setstate__(self, state):
        declared = "differentiable" in self.__dict__.get("defaults", state.get("defaults", {}))
        super().__setstate__(state)
        self.state = self.__dict__["state"]  # torch's __setstate__ sets it in __dict__, past the setter
        if not declared:  # torch adds it to defaults; an optimizer that does not take it keeps it out of its groups
            self.defaults.pop("differentiable", None)
        for options in (self.defaults, *self.param_groups):  # pickled before master_bits existed
            options.setdefault("master_bits", 16)
        self.__dict__.setdefault("shard_group", None)
        self._find_reduce_group()

    # --- step -----------------------------------------------------------------------------------

    @staticmethod
    def profile_hook_step(func):
        """torch's wrapper of ``step`` (its pre- and post-hooks, global ones first and last, and a
        profiler range), except that the range is entered only while a profiler runs (or dynamo
        traces): entering it costs more than a bound step's Python."""
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if not (torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled()):
                return _run_step_hooks(func, args[0], args, kwargs)
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(args[0]).__name__}.step"):
                return _run_step_hooks(func, args[0], args, kwargs)
        return wrapper

    # GradScaler hands its scale and found_inf to step() (as attributes) instead of unscaling the
    # grads itself: the fused kernels consume them in the same pass, with no host sync.
    _step_supports_amp_scaling = True

    @without_grad
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        Every group is checked before anything changes, so a step that raises changes nothing.
        Where every group ran on tables bound to native code, the next step checks no tensor in
        Python (see :class:`BoundStep`) and runs all its tables in one native call, which checks
        them all before any runs; where that call finds something changed, the step runs again
        the checked way."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            self._init_group()  # run eagerly by torch.compile, at tracing
            caches = self._engine_caches
            # Never raises: comparing the state's identity and its count makes dynamo guard them, so that
            # the step traced on the states _init_group found is traced again (and _init_group run again)
            # once a state dict changes or another is assigned (whose count may be the same). The caches
            # hold the traced state, so no other takes its id.
            traced_state, traced_changes = caches["traced state"]
            if id(self.state) != id(traced_state) or self.state.changes != traced_changes:
                raise RuntimeError("fastoptim: a state dict changed while a step was traced")
            self._apply([(group, *self._traced_group_work(caches["patterns"][index, _grads_pattern(group["params"])],
                                                          group))
                         for index, group in enumerate(self.param_groups)], caches)
            # a traced step notes no version counters: the next eager step starts afresh (set only where an
            # eager step left notes: a key added at every call would change the caches' length, a guard)
            if caches.get("writes") is not None:
                caches["writes"] = None
            return loss
        if flat_params.GRAD_BUFFERS:
            flat_params.drop_frozen_grads(self.param_groups)
        release = self.__dict__.get("_release")
        if release is not None:
            release.step()
            return loss
        caches = self.__dict__.setdefault("_engine_caches", {})
        bound = caches.pop("bound", None)
        if bound is not None and bound.step(self, caches):
            caches["bound"] = bound
            return loss
        work = [(group, *self._group_work(caches, index, group)) for index, group in enumerate(self.param_groups)]
        self._apply(work, caches)
        # not where the step reduces over ranks: a step run again would reduce twice on this rank alone
        caches["bound"] = None if self._reduce_group is not None else BoundStep.of(
            self.state, work, [self._algorithm(group) for group, _, _ in work], self._counts, self._structure,
            engines.backends.forced())
        return loss

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of every param, as torch.optim's ``zero_grad`` does, except that a grad that
        is a view of a flat grad buffer (:func:`fastoptim.flatten_parameters`) is zeroed in place, not
        set to None, so that backward accumulates into its buffer again.

        Args:
            set_to_none: set the other grads to None (default), or zero every grad in place.

        Under gradient release, it first ends a step that a backward began and ``step()`` did not (the
        backward raised): see :meth:`GradientRelease.zero_grad <fastoptim.optimizers.release.GradientRelease.zero_grad>`.
        """
        release = self.__dict__.get("_release")
        if release is not None:
            release.zero_grad()
        if not set_to_none or not flat_params.GRAD_BUFFERS:
            return super().zero_grad(set_to_none)
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            flat_params.zero_grads(param for group in self.param_groups for param in group["params"])

    def _check_between_steps(self, group, params):
        """Raise if what a scheduler or the user may have set in ``group`` since the last step does not
        fit ``params`` (those with grads): a tensor lr, a ``PER_GROUP`` count (see ``_group_count``)."""
        if isinstance(group["lr"], Tensor) and params:
            check_tensor_lr(group["lr"], params[0].device)
        if self._algorithm(group).counts == PER_GROUP:
            self._group_count(group)

    def _structure(self, group):
        """What of ``group``'s options decides its step work: its state roles, engine and formats."""
        return (self._roles(group), engines.engine_name(group["foreach"], group["fused"]),
                self._states_chosen(group), group.get("sn"), group.get("subset_size"))

    def _states_chosen(self, group):
        """The options that a group's states and what ``_prepare_states`` made of them were made under:
        state_bits and master_bits (the states' formats), and those its algorithm's ``param_factors``
        read. When one changes, the states are checked again and their context made again."""
        return (group["state_bits"], group["master_bits"],
                *(group[key] for key in self._algorithm(group).factor_options))

    def _roles(self, group):
        """The state roles the engines update under ``group``'s options: the algorithm's, and the
        master remainders of bf16 params (a role of their own: no algorithm reads them)."""
        algorithm = self._algorithm(group)
        roles = algorithm.spec.kept(algorithm.flags(group))
        return roles + (master.KEY,) if group["master_bits"] > 16 else roles

    def _apply(self, work, caches, whole_step=True):
        """Step every group of ``work`` ((group, GroupWork, grads) per group, all checked), each bucket
        on its engine. A released bucket is not a ``whole_step``: the per-group counts advance once, at
        ``step()``."""
        found_inf = getattr(self, "found_inf", None)
        eager = not torch.compiler.is_compiling()
        writes = self._restart_written(work, caches) if eager else None  # a traced step does not look
        # Eagerly, only the fused kernels skip an inf step on the device. The other engines look at
        # found_inf, and so do a step that would create states and one whose math is not elementwise
        # (Muon's kernel is half its step): a skipped step must leave no trace.
        # A traced step has its states, and every engine skips in the graph (engines.amp), but the loop
        # engine of subsets that span shards, which all-reduces as it goes.
        if found_inf is not None and any(
                entry.params and (eager and (entry.engine not in engines.FUSED or entry.states is None
                                             or not self._algorithm(group).spec.elementwise)
                                  or any(reduce for _, reduce in entry.buckets)) for group, entry, _ in work):
            if found_inf.item():
                return
            found_inf = None
        increment, scales, _ = self._grad_scales(work, found_inf, eager)
        for (group, entry, grads), scale in zip(work, scales):
            if entry.params:
                self._step_group(group, entry, grads, scale, found_inf, increment)
        self._advance(work, increment, writes, whole_step)

    def _restart_written(self, work, caches):
        """A param written by anyone but this optimizer starts again from the value written: zero the
        master remainders of ``work``'s params written since its steps wrote them (see master.Writes),
        whose notes it returns."""
        writes = caches.get("writes")
        if writes is None:
            writes = caches["writes"] = master.Writes()
        for _, entry, _ in work:
            if entry.versions is not None:
                self._restart_masters(writes.written(entry.versions))
        return writes

    def _grad_scales(self, work, found_inf, eager, clip_in_step=False):
        """What a step of ``work`` adds to the counts (1, or a tensor: 0 on a step GradScaler skipped),
        each group's grad scale (the clip coefficient, GradScaler's 1/scale, −1 to maximize: see
        ``scalars.grad_scale``) and, with ``clip_in_step`` (a bound step, whose native call clips), what
        that call clips by: (max_norm, eps, 1/scale), the groups' scales then leaving the coefficient out."""
        amp_scale = getattr(self, "grad_scale", None)
        max_norm = self.defaults["max_grad_norm"]
        # in bucket order, as a step's one native call takes them: every path sums the norm in this order
        all_grads = [grads[i] for _, entry, grads in work for bucket, _ in entry.buckets for i in bucket
                     ] if max_norm > 0 else None
        clipped = max_norm > 0 and (all_grads or self._reduce_group is not None)  # each rank joins the reduction
        # official Adan takes eps for the clip from the last group; an algorithm without an eps (Lion),
        # torch's clip_grad_norm_'s, whatever keys its groups carry
        eps = self.param_groups[-1]["eps"] if "eps" in self.defaults else CLIP_EPS
        maximize = [group["maximize"] for group, _, _ in work]
        if not eager and self._factors_by_op(work, all_grads if clipped else None, amp_scale, found_inf):
            return (*scalars.traced_factors(all_grads if clipped else None, max_norm, eps, amp_scale, found_inf,
                                            maximize), None)
        increment, inv_scale = scalars.increment_of(found_inf), scalars.inverse_of(amp_scale)
        if clipped and clip_in_step:
            return increment, [scalars.grad_scale(None, inv_scale, m) for m in maximize], (max_norm, eps, inv_scale)
        clip = None
        if clipped:  # the norm's dtype from the params' (the grads have theirs: checked before any kernel runs)
            wide = torch.float64 if any(entry.scalar_dtype is torch.float64 for _, entry, _ in work) else torch.float32
            clip = clip_coefficient(all_grads, max_norm, eps, inv_scale, self._reduce_group, wide=wide)
        return increment, [scalars.grad_scale(clip, inv_scale, m) for m in maximize], None

    def _advance(self, work, increment, writes, whole_step=True, counted=False):
        """After a step of ``work``: its counts advanced by ``increment`` (see ``_count_step``; where the
        step's native call ``counted`` those of the groups with params, their version counters bumped,
        as ``add_`` bumps them) and, where its ``writes`` are watched, the version counters its writes
        left noted."""
        for group, entry, _ in work:
            if counted and entry.params:
                bump_versions(self._counts(group, entry))
            else:
                self._count_step(group, entry, increment, whole_step)
            if writes is not None and entry.versions is not None:
                writes.note(entry.versions)

    def _init_group(self):
        """The eager part of a step that torch.compile traces. torch.compile runs an optimizer's
        ``_init_group`` eagerly while it traces ``step`` (as it does torch.optim's), so the
        per-tensor Python that decides a step (the checks, the states' creation, which tensors the
        fused kernel takes) runs once, untraced, and is not traced again on the next call. The
        trace reads the decisions from each group's work (``_traced_group_work``), and dynamo's
        guards on every tensor it reads keep them valid. Every group is prepared in one call: dynamo
        reads the state dict once, after it. The states are created here, even for a step that
        GradScaler then skips: zeros, and the step count stays, so the trajectory is eager's."""
        caches = self.__dict__.setdefault("_engine_caches", {})
        flat_params.drop_frozen_grads(self.param_groups)  # a step traced again once a param is frozen (guarded)
        for index, group in enumerate(self.param_groups):
            entry, grads = self._group_work(caches, index, group)
            if entry.states is None and entry.params:
                self._use_new_states(group, entry, traced=True)
            algorithm = self._algorithm(group)
            fused = entry.engine in engines.FUSED and entry.params and algorithm.kernel_scalars is not None
            tensors = entry.tensors | {"grad": entry.viewed(grads)} if fused else None
            for bucket_index, (bucket, _) in enumerate(entry.buckets):
                cache = entry.bucket_caches.setdefault(bucket_index, {})  # made here, not by the traced step
                if fused:
                    part = pick(tensors, bucket)
                    if _keeps_no_remainders(part):
                        del part[master.KEY]
                    absmax = pick(entry.absmax, bucket)
                    originals = [t for key, values in entry.kept.items() for i in bucket
                                 if isinstance(t := values[i], Tensor) and (key in part or key.endswith(ABSMAX))]
                    cache["traced split"] = engines.fused.split(part, absmax, algorithm.spec, originals,
                                                                functools.partial(_remade, entry, bucket))
            # a CPU kernel that takes every tensor gets its scalars from an op (see scalars.py)
            whole = fused and algorithm.run is engines.run_bucket and all(
                reduce is None and not entry.bucket_caches[i]["traced split"].left
                for i, (_, reduce) in enumerate(entry.buckets))
            entry.traced_scalars = scalars.prepare(algorithm, group) if (
                whole and entry.params[0].device.type == "cpu") else None
        caches["traced state"] = self.state, self.state.changes

    def _traced_group_work(self, entry, group):
        """A traced step's work for ``group``: the decisions ``_init_group`` took (``entry``) and the
        states it found, over the params and grads read where the user sees them, which the
        compiled step reads (and dynamo guards) on every call. The states are not read one by one
        (guards on each would cost as much as the step): the guard on the state dicts' change
        count stands for them, and native code checks their storage at every call."""
        params, local_params, grads = self._with_grads(group)
        return entry.traced(params, local_params), grads

    def _with_grads(self, group, params=None):
        """The group's params that have grads (of ``params``, some of them, if given), what the engines
        update of them (``engine_view``: the local shards of DTensors, the real views of complex
        params) and their grads, viewed alike."""
        params = [param for param in (group["params"] if params is None else params) if param.grad is not None]
        grads = [param.grad for param in params]
        if not self._viewed:
            return params, params, grads
        return params, list(map(engine_view, params)), list(map(engine_view, grads))

    def _group_work(self, caches, index, group, some=None):
        """The group's :class:`GroupWork` and its params' grads (local shards of DTensors), all
        checked; nothing is changed. ``some``: only these of its params (a released bucket), with
        ``index`` a key of their own."""
        params, local_params, grads = self._with_grads(group, some)
        roles = self._roles(group)
        engine = engines.engine_name(group["foreach"], group["fused"])
        self._check_between_steps(group, params)
        entry = caches.get(index)
        if entry is None or not entry.fits(roles, engine, params, local_params):
            check_params(params, type(self).__name__)  # a param's storage may have changed since it was added
            # The work of each pattern of grads seen is kept: a model whose frozen parts alternate
            # (a GAN's) comes back to one, and a compiled step to the graph it traced for it.
            patterns = caches.setdefault("patterns", {})
            key = (index, _grads_pattern(group["params"] if some is None else some))
            entry = patterns.get(key)
            if entry is None or not entry.fits(roles, engine, params, local_params):
                mine = [seen for seen in patterns if seen[0] == index]  # each group's own: all are in one step
                if key not in patterns and len(mine) >= GRADS_PATTERNS_KEPT:
                    for seen in mine:
                        del patterns[seen]
                versions = master.Versions(params) if master.KEY in roles else None
                entry = patterns[key] = GroupWork(roles, engine, params, local_params, Signature(params, local_params),
                                                  versions)
            caches[index] = entry
        self._check_grads(local_params, grads, entry.signature)
        states = list(map(self.state.get, params))
        if not entry.holds(states) or entry.states_chosen != self._states_chosen(group):
            entry.states = None
            for param, state in zip(params, states):
                self._check_state(param, state or {}, group)
        return entry, grads

    def _check_grads(self, params, grads, signature=None):
        """Raise if a gradient is sparse or does not match its parameter: the same shape, dtype and
        device (one device for the whole group). The fast test runs over all of them at once."""
        if (signature is not None and signature.one_device
                and all(map(operator.is_, map(attrgetter("layout"), grads), repeat(torch.strided)))
                and signature.matches(grads, SHAPE, DTYPE, DEVICE)):
            return
        name = type(self).__name__
        for param, grad in zip(params, grads):
            if grad.layout != torch.strided:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
                raise RuntimeError(
                    f"{name}: a gradient must match its parameter; got grad {grad.dtype} {tuple(grad.shape)} "
                    f"on {grad.device} for param {param.dtype} {tuple(param.shape)} on {param.device}")
        devices = {param.device for param in params}
        if len(devices) > 1:
            raise RuntimeError(f"{name}: all params of a group must be on one device, got {sorted(map(str, devices))}")

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
            if key == "step" and value is not None and not is_step_count(value, param.device):
                # a count set by hand (``state["step"] = 1``): _prepare_states takes it as torch takes one
                step_count(value, param.device, f"step of a param of shape {tuple(param.shape)}")
                continue
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

    def _step_group(self, group, entry, grads, grad_scale, found_inf, increment):
        if entry.states is None:  # every group is checked by now: states may be created
            self._use_new_states(group, entry, traced=torch.compiler.is_compiling())
        algorithm, traced = self._algorithm(group), torch.compiler.is_compiling()
        prepared = entry.traced_scalars if traced else None
        args, per_tensor = {}, ()  # where an op makes each bucket's scalars
        if prepared is None:
            args, per_tensor = self._arguments(algorithm, group, entry, grad_scale, increment, traced)
        else:
            counts, inputs = self._counts(group, entry), self._step_inputs(group, entry, grad_scale)
        plan = engines.Plan(entry.tensors | {"grad": entry.viewed(grads)}, algorithm.update, algorithm.spec,
                            algorithm.kernel_scalars, algorithm.flags(group), args,
                            frozenset(per_tensor), found_inf, group["stochastic_rounding"],
                            warn_fallback=group["fused"] is True, absmax=entry.absmax,
                            watched=entry.watched, grads_like=entry.grads_like,
                            rule="" if algorithm.rule is None else algorithm.rule[0],
                            counts=self._read_counts(group, entry))
        for index, (bucket, reduce_group) in enumerate(entry.buckets):
            whole = len(bucket) == len(entry.params)
            part = plan if whole else plan.subset(bucket)
            if prepared is not None:
                part.kernel_values = scalars.traced_kernel_scalars(
                    algorithm, prepared, group, counts, increment, inputs, found_inf, group["stochastic_rounding"],
                    entry.tensors["param"][0].device, len(entry.params), [] if whole else bucket)
            if _keeps_no_remainders(part.tensors):
                part = part.without(master.KEY)
            part.cache = entry.bucket_caches.setdefault(index, {})
            algorithm.run(entry.engine, part, reduce_group)
        first_reads = entry.context.first_reads
        if first_reads is not None:  # for one step: then every param has its optional states
            entry.context = entry.context._replace(first_reads=None)
            if prepared is not None:
                scalars.traced_mark_read(first_reads, increment)
            elif traced:  # a compiled step reads them again on every call, and a step that counts gave every
                first_reads.clamp_(min=increment)  # param its optional states

    def _arguments(self, algorithm, group, entry, grad_scale, increment, traced):
        """``algorithm``'s arguments for this step of ``group`` (``entry``: its work) and the names of those
        that hold one value per param (see ``scalars.step_arguments``)."""
        return scalars.step_arguments(algorithm, group, scalars.one_count(self._counts(group, entry)), increment,
                                      self._step_inputs(group, entry, grad_scale), traced)

    def _counts(self, group, entry):
        """The step counts ``group``'s step reads and advances (see ``scalars.one_count``): the
        group's (``PER_GROUP``), those of ``entry``'s params (``PER_PARAM``: as one tensor, or one
        each), or none."""
        counts = self._algorithm(group).counts
        if counts == PER_GROUP:
            return [self._group_count(group)]
        if counts == PER_PARAM and entry is not None and entry.params:
            return [entry.context.counts] if entry.context.counts is not None else [
                state["step"] for state in entry.states]
        return []

    def _step_inputs(self, group, entry, grad_scale):
        """The :class:`StepInputs` of this step of ``group`` besides its count (see ``_counts``)."""
        context = entry.context
        return StepInputs(group_lr(group), grad_scale, None, entry.scalar_dtype, context.first_reads, context.factors)

    def _use_new_states(self, group, entry, traced):
        """Create the missing states of ``entry``'s params and hand them to it, for a ``traced`` step or
        an eager one. (Not ``torch.compiler.is_compiling()`` here: it is False in the ``_init_group``
        that dynamo runs at tracing before torch 2.13.)"""
        states, context = self._prepare_states(entry.params, group, traced)
        partitions = [subset_norm.from_record(p.shape, s) for p, s in zip(entry.params, states)]
        spec = self._algorithm(group).spec
        entry.use_states(states, context, partitions, spec.reduced, self._reduce_group, not spec.elementwise)
        entry.states_chosen = self._states_chosen(group)  # checked again if one of these options changes

    def _partition(self, param, state, group):
        """The subset-norm partition of a param: the one its state records; for a state without a
        second moment yet, the group's (``sn``, ``subset_size``); None: a dense second moment, which
        a complex param always keeps (as its states, see ``formats.for_state``)."""
        if param.is_complex():
            return None
        if any(key in state for key in (*subset_norm.RECORDS, *self._algorithm(group).spec.reduced)):
            return subset_norm.from_record(param.shape, state)
        return subset_norm.from_options(param.shape, group.get("subset_size")) if group.get("sn") else None

    def _formats(self, group, param, state):
        """The format of each state role of ``param`` that ``group``'s options keep (see
        fastoptim.states.formats), and its subset-norm partition (None: dense)."""
        partition, algorithm = self._partition(param, state, group), self._algorithm(group)
        return {role: formats.for_state(param, algorithm.spec.role(role), group["state_bits"], partition)
                for role in algorithm.spec.kept(algorithm.flags(group))}, partition

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
        if master.dtype(param, group["master_bits"]) is not None and master.KEY not in state:
            add({master.KEY: master.zeros(like, group["master_bits"])})
        return state

    def _expected_state(self, group, param, state):
        """The (shape, dtype) of each state tensor that a param's state must have, companions
        (an 8-bit state's block maxima) included."""
        states_formats, partition = self._formats(group, param, state)
        expected = {"step": (torch.Size([]), torch.float32)} if self._algorithm(group).counts == PER_PARAM else {}
        for role, state_format in states_formats.items():
            expected |= state_format.expected(param, self._algorithm(group).spec.role(role), partition)
        remainder = master.dtype(param, group["master_bits"])
        if remainder is not None:
            expected[master.KEY] = (param.shape, remainder)
        return expected

    def _prepare_states(self, params, group, traced):
        """The state dicts of a group's params with grads, with missing states created, and their
        :class:`StateContext`, which ``_step_inputs`` reads. Called when they change, not every
        step. New states are made in flat buffers (``multi_tensor.FlatStates``): a fused step checks
        a buffer per key instead of a tensor per state, and per-param counts are views of one tensor,
        so a step adds to them in one op (2000 separate 0-d tensors cost milliseconds of dispatch),
        and a compiled step hands its op a few buffers; not for DTensor or complex params. A ``traced``
        step leaves per-param counts it finds apart as they are (see below)."""
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
        counts = None
        if algorithm.counts == PER_PARAM:
            for param, state in zip(params, states):
                if not is_step_count(state["step"], param.device):  # one set by hand, checked by _check_state
                    state["step"] = step_count(state["step"], param.device)
            steps = [state["step"] for state in states]
            counts = steps[0]._base
            if counts is None or not are_slots(counts, steps):
                # A traced step leaves them unpacked (its counts are then stacked in the graph): the step
                # traced for another pattern of grads (a GAN's halves) guards the state dicts packing changes.
                counts = None if traced else torch.stack(steps)
                for i, state in enumerate(states if counts is not None else ()):
                    state["step"] = counts[i]
        factors = None if algorithm.param_factors is None else torch.tensor(
            [algorithm.param_factors(group, param) for param in params], dtype=torch.float64, device=device)
        first_reads = torch.tensor(first_reads, device=device) if 0.0 in first_reads else None
        return states, StateContext(counts, factors, first_reads)

    def _algorithm(self, group):
        """The :class:`Algorithm` that steps ``group``: the optimizer's own."""
        return self.algorithm

    def _group_count(self, group):
        """A ``PER_GROUP`` algorithm's step count: ``group["step"]``, a 0-d fp32 tensor on the
        group's device (created at 0). One that the user set as a number (official Adan keeps an
        int) or as another tensor is taken as such a tensor, as a loaded one is, or refused with a
        ValueError (see ``checks.step_count``)."""
        count = group.get("step", 0)
        device = group["params"][0].device if group["params"] else getattr(count, "device", None)
        if not is_step_count(count, device):
            group["step"] = count = step_count(count, device)
        return count

    def _read_counts(self, group, entry):
        """Per param of ``entry``, the step count its step reads (a ``PER_GROUP`` count for each), or None."""
        counts = self._algorithm(group).counts
        if counts == PER_GROUP:
            return [self._group_count(group)] * len(entry.params)
        return [state["step"] for state in entry.states] if counts == PER_PARAM else None

    def _count_step(self, group, entry, increment, whole_step=True):
        """Advance the group's step counts by ``increment`` (1, or 0 on a step GradScaler skipped),
        after the update: a ``PER_GROUP`` count whether or not its params had grads (on a
        ``whole_step``: not for each released bucket), ``PER_PARAM`` counts of the params of
        ``entry`` that had (None: the per-group counts of a released step alone)."""
        if not whole_step and self._algorithm(group).counts == PER_GROUP:
            return  # a released bucket: the group's count advances at step()
        counts = self._counts(group, entry)
        if not counts:
            return
        traced = torch.compiler.is_compiling()
        if traced and counts[0].device.type == "cpu" and (
                entry is None or not entry.params or entry.traced_scalars is not None):
            scalars.traced_count_up(counts, increment)
        elif len(counts) == 1:
            counts[0].add_(increment)
        else:
            torch._foreach_add_(counts, increment)

    def _factors_by_op(self, work, clipped_grads, amp_scale, found_inf):
        """Whether a traced step computes its clip coefficient and GradScaler's factors through
        ``fastoptim::step_factors``: where it has some, and an op computes every group's scalars (see
        ``scalars``), and the clip's sum of squares is the CPU clip kernel's, over this rank's grads."""
        return ((clipped_grads is not None or amp_scale is not None or found_inf is not None)
                and self._reduce_group is None
                and all(entry.traced_scalars is not None for _, entry, _ in work if entry.params)
                and (clipped_grads is None or clip_backend(clipped_grads) is not None))

    def enable_gradient_release(self, bucket_numel: int = release.BUCKET_NUMEL, *,
                                model: torch.nn.Module | None = None) -> release.GradientRelease:
        """Step each bucket of params in backward, as soon as all its grads are final, and free those
        grads there: a model's grads are then never all held at once. ``step()`` steps what backward
        left (the buckets whose params did not all get a grad, params a reentrant checkpoint
        accumulates into, params new to a group) and advances the step counts; ``zero_grad()`` finds
        nothing to clear. Without stochastic rounding, the results are a normal ``backward(); step()``'s
        bit for bit (with it, the same distribution: the random bits are drawn per bucket). The
        buckets follow the groups (params added, or starting or ceasing to require grad); flat grads
        (:func:`fastoptim.flatten_parameters`) are zeroed in place, not freed; the hooks hold the
        optimizer weakly and go with it.

        Under DDP or FSDP2, pass the model (``model=``): a grad is final once reduced over the ranks.
        Under FSDP2 (a ``fully_shard`` model), a bucket steps on its local shards as its units'
        reduce-scatters land, and frees them. Under DDP (a ``DistributedDataParallel`` model), release
        registers a comm hook that averages and all-reduces each DDP bucket as DDP does without one, and
        a bucket steps once its params' all-reduces have landed; their grads are views of DDP's bucket
        buffers (held by DDP anyway) until ``step()``. Both give the unreleased run bit for bit;
        accumulate with ``no_sync()`` or ``set_requires_gradient_sync(False)``, whose backwards reduce
        nothing, so step nothing.

        Refused, before anything changes, where release cannot be exact: ``max_grad_norm`` (the
        norm of all grads), a process group without ``model=`` (DDP and FSDP reduce the grads after
        backward), FSDP1, a DDP with another comm hook or ``find_unused_parameters=True``, an FSDP2
        model that does not hold every trained param, ZeRO's ``shard_group``, or release already on.
        After it, a second backward before ``step()`` (gradient accumulation) raises in
        backward, ``fastoptim.clip_grad_norm_`` refuses the released params, and ``step()`` refuses
        GradScaler's scale (the steps in backward took the scaled grads); torch's own
        ``clip_grad_norm_`` would find no grads. An option set between backward and ``step()`` (a
        scheduler stepped first) came too late for the buckets backward stepped: ``step()`` warns,
        once. A backward that raised after stepping some buckets is ended by ``zero_grad()``.

        Args:
            bucket_numel: the elements of the params stepped together (each param group's, in
                reverse order, as backward reaches them); at least 1.
            model: the ``DistributedDataParallel`` or ``fully_shard`` (FSDP2) model whose reductions
                make the grads final; None in one process.

        Returns:
            The handle: ``handle.remove()`` turns release off.
        """
        if type(bucket_numel) is not int or bucket_numel < 1:
            raise ValueError(f"Invalid bucket_numel: {bucket_numel!r} (must be an int >= 1)")
        reason = release.refusal(self, model)
        if reason is not None:
            raise RuntimeError(f"fastoptim: gradient release is refused: {reason}")
        self._release = release.GradientRelease(self, bucket_numel, model)
        return self._release

    @without_grad
    def _step_released(self, key, group_index, params):
        """Step ``params`` of group ``group_index`` on their grads (a released bucket, or what backward
        left; ``key``: their step work's in the caches), checked as a step checks them; the group's
        per-group count advances at ``step()``."""
        caches = self.__dict__.setdefault("_engine_caches", {})
        caches.pop("bound", None)  # the next normal step is checked again
        group = self.param_groups[group_index]
        self._apply([(group, *self._group_work(caches, key, group, params))], caches, whole_step=False)

    def _restart_masters(self, params):
        """Zero the master remainders of ``params``, written by someone else since this optimizer's
        step last wrote them: each starts again from the value written (see master.Writes)."""
        for param in params:
            remainder = self.state.get(param, {}).get(master.KEY)
            if remainder is not None:
                remainder.zero_()

    def _restart_written_masters(self):
        """:meth:`_restart_masters` of every param written since this optimizer's step last wrote it."""
        writes = self.__dict__.get("_engine_caches", {}).get("writes")
        if writes is not None:
            self._restart_masters(writes.all_written())

    def master_state_dict(self, module: torch.nn.Module) -> dict[str, Tensor]:
        """``module.state_dict()`` with each bf16 param that keeps a master remainder here (under
        ``master_bits`` 24 or 32) replaced by its master, in fp32: the weights to export or evaluate
        at the precision the optimizer trains (the module's own state dict holds the rounded bf16
        params). A param written since this optimizer's step last wrote it is its own master: its
        remainder, which belonged to the value it replaced, is zeroed (as the next step would).
        Every other entry is the module's.

        Args:
            module: the model whose params (some or all) this optimizer steps.
        """
        self._restart_written_masters()
        masters = {id(param): state[master.KEY] for param, state in self.state.items()
                   if isinstance(state, dict) and master.KEY in state}
        named = dict(module.named_parameters(remove_duplicate=False))
        state_dict = module.state_dict()
        for name, param in named.items():
            remainder = masters.get(id(param))
            if remainder is not None and name in state_dict:
                full = master.widen(distributed.local(param.detach()), distributed.local(remainder))
                state_dict[name] = distributed.like(full, param) if distributed.is_dtensor(param) else full
        return state_dict

    def _forget_engine_caches(self):
        """Drop the step work and pointer tables, which hold the states: for when states are replaced."""
        self.__dict__.pop("_engine_caches", None)

    # --- state dicts ----------------------------------------------------------------------------
