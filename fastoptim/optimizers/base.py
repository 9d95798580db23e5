"""The contract every fastoptim optimizer keeps: torch.optim's (param groups, ``step``, state
dicts, hooks), with every input checked before anything changes, and one step path for all
algorithms. A subclass declares its algorithm (an :class:`Algorithm` record) and its options; this
class holds them, its states are made and checked by state_creation.py, and its step path
(step_path.py) counts the steps and runs them."""
import functools
import operator
import warnings
from itertools import repeat

import torch
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import distributed, engines, flat_params
from ..bound_step import BoundStep
from ..optimizer_state import OptimizerState
from ..states import master
from ..step_cache import PlanStore
from .algorithm import PER_GROUP, Algorithm
from . import release
from .release_reductions import refusal
from .checks import (check_bool_options, check_hyperparameters, check_number, check_params, check_plan_options,
                     check_tensor_lr, flag_value, normalize_betas, one_value)
from .state_creation import StateCreation
from .step_counts import group_count
from .step_path import StepPath, without_grad
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

def in_dtype(value, dtype):
    """A scalar of the step in ``dtype`` when it is a tensor (a Python float needs no cast)."""
    return value.to(dtype) if isinstance(value, Tensor) else value


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


class FastOptimizer(StepPath, StateCreation, StateDicts, torch.optim.Optimizer):
    """The base of every fastoptim optimizer. A subclass gives:

    - ``algorithm``: its :class:`Algorithm` (fastoptim.optimizers.algorithm), declared beside its math;
    - ``__init__``: its signature and defaults, collected into ``defaults`` for this one's;
    - optionally ``_check_group`` (its own options), and ``_algorithm(group)`` where some groups run
      another algorithm (Muon's AdamW companions);
    - optionally ``clip_eps``: the option whose last group's value ``max_grad_norm``'s clip adds to the norm
      (official Adan's rule), or None for torch's clip_grad_norm_'s 1e-6 (an algorithm without one).
    """

    algorithm: Algorithm
    clip_eps: str | None = "eps"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and COMMON_ARGS_LINE in cls.__doc__:
            cls.__doc__ = cls.__doc__.replace(COMMON_ARGS_LINE, COMMON_ARGS)
        spec = cls.__dict__["algorithm"].spec if "algorithm" in cls.__dict__ else None
        if spec is not None and spec.elementwise:  # its fused kernels' op, which torch.compile keeps
            engines.step_op.define_op(spec)

    def __init__(self, params, defaults, shard_group):
        """``shard_group``: the process group whose ranks' params, together, are the model's, each
        once (ZeroRedundancyOptimizer's partition); global reductions run over it. Not a group
        option: ZeroRedundancyOptimizer consumes ``process_group``, and param groups go into state dicts.

        The hyperparameters are checked before the params, as torch.optim checks them."""
        normalize_betas(defaults)
        # the clip's threshold as a Python number: each step compares it, and its natively computed coefficient
        defaults["max_grad_norm"] = one_value("max_grad_norm", defaults["max_grad_norm"])
        self._check_group(defaults, defaults["max_grad_norm"])
        distributed.check_shard_group(shard_group)
        self.shard_group = shard_group
        self._plans = PlanStore()
        self._max_grad_norm = defaults["max_grad_norm"]  # see _optimizer_inputs
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
        self._optimizer_inputs()  # a threshold written since: taken before the new group is checked against it
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
            self._find_reduce_group()
            if self._algorithm(group).counts == PER_GROUP:
                group_count(group)  # now, not at the first step: a compiled step must find it
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group, max_grad_norm=None):
        check_hyperparameters(group, self._algorithm(group).n_betas)
        check_bool_options(group, type(self))
        self._check_plan(group)
        held = self.defaults["max_grad_norm"] if max_grad_norm is None else max_grad_norm
        if group["max_grad_norm"] != held:
            raise ValueError(f"Invalid max_grad_norm: {group['max_grad_norm']!r}: it clips by the norm over all "
                             f"groups, so a group holds the optimizer's, {held!r} (write every group's to change it)")
        engines.engine_name(flag_value("foreach", group["foreach"]), flag_value("fused", group["fused"]))

    def _check_plan(self, group):
        """Raise a ValueError naming the first of ``group``'s options that decide its step's plan that the
        optimizer does not take (``checks.check_plan_options``, and those its algorithm and params rule
        out): when the group is added, and whenever its plan's structure is computed again, for an option
        written between steps."""
        check_plan_options(group)
        if one_value("sn", group.get("sn")) and not self._algorithm(group).spec.reduced:
            raise ValueError(f"Invalid sn: {type(self).__name__} keeps no second moment, so sn does not apply")
        if one_value("master_bits", group["master_bits"]) > 16 and any(
                param.dtype == torch.float16 for param in group.get("params", ())):
            raise ValueError(f"Invalid master_bits: {group['master_bits']} keeps remainders of bf16 params; an "
                             "fp16 param's bits do not split that way. Use bf16 (or fp32) params, or master_bits=16")

    def _find_reduce_group(self):
        """The group of this optimizer's global reductions (see fastoptim.distributed), whether its
        params are DTensors, whose local shards the engines update, and whether the engines update
        another view of some params than the params (DTensors, complex params: ``engine_view``)."""
        params = [param for group in self.param_groups for param in group["params"]]
        self._reduce_group = distributed.reduction_group(params, self.shard_group)
        self._sharded = any(distributed.is_dtensor(param) for param in params)
        self._viewed = self._sharded or any(param.is_complex() for param in params)

    def __getstate__(self):  # a copy keeps shard_group, or fails loudly where a group cannot be copied
        # and the clip threshold last taken, beside which a write since is told (see _optimizer_inputs)
        return super().__getstate__() | {"shard_group": self.shard_group, "_max_grad_norm": self._max_grad_norm}

    def __setstate__(self, state):
        declared = "differentiable" in self.__dict__.get("defaults", state.get("defaults", {}))
        super().__setstate__(state)
        self._plans = PlanStore()  # a copy plans its own steps
        self.state = self.__dict__["state"]  # torch's __setstate__ sets it in __dict__, past the setter
        if not declared:  # torch adds it to defaults; an optimizer that does not take it keeps it out of its groups
            self.defaults.pop("differentiable", None)
        for options in (self.defaults, *self.param_groups):  # pickled before master_bits existed
            options.setdefault("master_bits", 16)
        self.__dict__.setdefault("shard_group", None)
        self.__dict__.setdefault("_max_grad_norm", self.defaults["max_grad_norm"])  # pickled before it was kept
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

    def _optimizer_inputs(self, traced=False):
        """What a step reads of the optimizer beside its groups, checked before anything changes:
        GradScaler's ``found_inf`` and ``grad_scale`` (None where unset), each a tensor of one value, read
        as a 0-d one (anything else, a number set by hand, is refused by name: one way of the step took it,
        another raised), and ``max_grad_norm``, as written since the last step into ``defaults`` (official
        Adan's way) or into the groups (torch.optim's way). That clips by the norm over all groups, so it
        holds one value, which this writes back to both; written as two values, or as no number >= 0, it
        is refused by name. A ``traced`` step reads ``defaults``' (``_init_group`` took what was written)."""
        found = []
        for name in ("found_inf", "grad_scale"):
            value = getattr(self, name, None)
            if value is not None and not (isinstance(value, Tensor) and value.numel() == 1):
                raise ValueError(f"Invalid {name}: {value!r} (GradScaler's: a tensor of one value, or None)")
            found.append(value.reshape(()) if value is not None and value.dim() else value)
        if traced:
            return (*found, self.defaults["max_grad_norm"])
        held = self._max_grad_norm
        values = [self.defaults["max_grad_norm"], *[group.get("max_grad_norm", held) for group in self.param_groups]]
        if all(map(operator.is_, values, repeat(held))):  # the common case: no compare (a tensor's is one)
            return (*found, held)
        is_written = [value is not held and not (type(value) in (float, int) and value == held) for value in values]
        written = [one_value("max_grad_norm", value) for value, new in zip(values, is_written) if new]  # numpy's value
        if not written:  # equal values of other objects (a loaded state dict's)
            return (*found, held)
        for value in written:
            check_number("max_grad_norm", value)
        if len(set(written)) > 1:
            raise ValueError(f"Invalid max_grad_norm: written as {sorted(set(written))} since the last step; it "
                             "clips by the norm over all groups, so it holds one value (set it in every group, "
                             "or in defaults)")
        if not is_written[0] and not all(is_written[1:]):  # a per-group threshold, which is none
            raise ValueError(f"Invalid max_grad_norm: {written[0]!r} written into {len(written)} of the "
                             f"{len(is_written) - 1} groups; it clips by the norm over all groups, so write it into "
                             "every group, or into defaults")
        if written[0] > 0 and self.__dict__.get("_release") is not None:
            raise ValueError(f"Invalid max_grad_norm: {written[0]!r}: it clips by the norm of all grads, which "
                             "gradient release never holds at once (remove its handle first)")
        held = self._max_grad_norm = self.defaults["max_grad_norm"] = written[0]
        for group in self.param_groups:
            group["max_grad_norm"] = held
        return (*found, held)

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
        release = self.__dict__.get("_release")
        if release is not None:  # backward stepped the rest, eagerly, even in a compiled step (see release)
            release.step()
            return loss
        if torch.compiler.is_compiling():
            self._init_group()  # run eagerly by torch.compile, at tracing
            plans = self._plans
            # Never raises: comparing the state's identity and its count makes dynamo guard them, so that
            # the step traced on the states _init_group found is traced again (and _init_group run again)
            # once a state dict changes or another is assigned (whose count may be the same). The store
            # holds the traced state, so no other takes its id.
            patterns = self._grads_patterns()
            traced_state, traced_changes = plans.traced_states[patterns]
            if id(self.state) != id(traced_state) or self.state.changes != traced_changes:
                raise RuntimeError("fastoptim: a state dict changed while a step was traced")
            self._apply([(group, *self._traced_group_work(plans.patterns[index, pattern], group))
                         for index, (group, pattern) in enumerate(zip(self.param_groups, patterns))],
                        plans, traced=True)
            # a traced step notes no version counters: the next eager step starts afresh (set only where an
            # eager step left notes: a write at every call would be a side effect of every graph)
            if plans.writes is not None:
                plans.writes = None
            return loss
        plans = self._plans
        bound, plans.bound = plans.bound, None
        if bound is not None and bound.step(self, plans):  # which drops frozen flat grads as it reads the grads
            plans.bound = bound
            return loss
        with flat_params.frozen_grads_dropped(self.param_groups):
            work = [(group, *self._group_work(plans, index, group)) for index, group in enumerate(self.param_groups)]
            self._check_apart([entry for _, entry, _ in work])
            self._apply(work, plans)
        # not where the step reduces over ranks: a step run again would reduce twice on this rank alone
        plans.bound = None if self._reduce_group is not None else BoundStep.of(
            self.state, work, [self._algorithm(group) for group, _, _ in work])
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
            release.zero_grad(set_to_none)
        if not set_to_none or not flat_params.GRAD_BUFFERS:
            return super().zero_grad(set_to_none)
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            flat_params.zero_grads(param for group in self.param_groups for param in group["params"])

    def _algorithm(self, group):
        """The :class:`Algorithm` that steps ``group``: the optimizer's own."""
        return self.algorithm

    def _algorithms(self):
        """Every :class:`Algorithm` that steps a group of this optimizer (see :meth:`_algorithm`)."""
        return (self.algorithm,)

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
        model that does not hold every trained param, ZeRO's ``shard_group``, release already on, or params
        that another optimizer's live release steps (``remove()`` its handle first).
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
        reason = refusal(self, model)
        if reason is not None:
            raise RuntimeError(f"fastoptim: gradient release is refused: {reason}")
        self._release = release.GradientRelease(self, bucket_numel, model)
        return self._release

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

    # --- state dicts ----------------------------------------------------------------------------
