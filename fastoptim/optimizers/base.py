"""What every fastoptim optimizer shares: the torch.optim contract, input validation, bucketing,
engine dispatch and state-dict conversion. A subclass states its algorithm: hyperparameters, state
layout, per-step scalars and ``update``, the math written once."""
import math
import operator
import warnings
from collections import defaultdict
from copy import deepcopy
from itertools import repeat
from operator import attrgetter

import torch
from torch import Tensor

from .. import distributed, engines
from ..clip import clip_coefficient
from ..multi_tensor import buckets
from ..specs import KernelSpec
from ..states import blockwise8, subset_norm


def normalize_betas(group):
    """Take one-element tensor betas as the numbers they hold (as torch.optim accepts them): the
    step's math reads betas as numbers, so a tensor beta is read once, when its group is added or
    loaded, and later changes to it in place are not followed."""
    betas = group["betas"]
    if isinstance(betas, (tuple, list)) and any(isinstance(beta, Tensor) for beta in betas):
        for i, beta in enumerate(betas):
            if isinstance(beta, Tensor) and (beta.numel() != 1 or not beta.is_floating_point()):
                raise ValueError(f"Invalid betas[{i}]: a Tensor beta must hold one floating-point number, got "
                                 f"{beta.dtype} of shape {tuple(beta.shape)}")
        group["betas"] = tuple(beta.item() if isinstance(beta, Tensor) else beta for beta in betas)


def check_hyperparameters(group, n_betas):
    """Raise a ValueError that names the first invalid hyperparameter of ``group``."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        check_tensor_lr(lr)
        lr = lr.item()  # construction time only, never in step()
    for name, value in (("lr", lr), *((name, group[name]) for name in ("eps", "weight_decay", "max_grad_norm")
                                      if name in group)):  # an algorithm may take no eps (Lion)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < math.inf):
            raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != n_betas:
        raise ValueError(f"Invalid betas: {betas!r} (expected {n_betas} numbers)")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid betas[{i}]: {beta!r} (must be in [0, 1))")
    for flag in ("foreach", "fused"):
        if group[flag] not in (None, True, False):
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be None, True or False)")
    for flag in ("maximize", "stochastic_rounding", "sn"):
        if not isinstance(group.get(flag, False), bool):
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be True or False)")
    subset_norm.check_subset_size(group.get("subset_size"))
    if type(group["state_bits"]) is not int or group["state_bits"] not in (8, 16, 32):
        raise ValueError(f"Invalid state_bits: {group['state_bits']!r} (must be 32, 16 for bf16 states or 8 for "
                         "8-bit blockwise states)")


def check_tensor_lr(lr, device=None):
    """A Tensor lr must hold one floating-point number (any shape, as torch.optim accepts) on the
    params' device, where the kernels read it."""
    if lr.numel() != 1 or not lr.is_floating_point():
        raise ValueError(f"Invalid lr: a Tensor lr must be a one-element floating-point tensor, got {lr.dtype} "
                         f"of shape {tuple(lr.shape)}")
    if device is not None and lr.device != device:
        raise ValueError(f"Invalid lr: a Tensor lr must be on the params' device, {device}, not {lr.device}")


def state_dtype(param, role=None, state_bits=32, reduced=False, half_roles=()):
    """The dtype a state of ``param`` is kept in. States are fp32 whatever the param's dtype, except:
    a float64 param keeps float64 states and math (rounding it through fp32 would change it);
    ``state_bits=16`` keeps bf16 states; ``state_bits=8`` keeps 8-bit blockwise ones (uint8 codes,
    see fastoptim.states.blockwise8), and bf16 ones for ``half_roles``, for params of at least
    MIN_NUMEL elements. A subset-norm second moment (``reduced``) stays fp32: it is small."""
    if param.dtype == torch.float64:
        return torch.float64
    if reduced or state_bits == 32 or role == "step":
        return torch.float32
    if state_bits == 16:
        return torch.bfloat16
    if param.numel() < blockwise8.MIN_NUMEL:
        return torch.float32
    return torch.bfloat16 if role in half_roles else torch.uint8


def new_state(param, shape, dtype, role, partition):
    """A zero state (and its block maxima for an 8-bit one, under ``{role}_absmax``): param-shaped,
    or a second moment in ``partition``'s shape. DTensor params get DTensor states (see
    fastoptim.distributed), and 8-bit ones block maxima over their local shard."""
    if shape != param.shape:
        return {role: distributed.reduced_zeros(param, partition, dtype)}
    if dtype != torch.uint8:
        return {role: torch.zeros_like(param, dtype=dtype)}
    zero = blockwise8.codes_for(role).zero  # what quantizing zeros gives, without the work
    return {role: torch.full_like(param, zero, dtype=torch.uint8),
            role + ABSMAX: torch.zeros(blockwise8.n_blocks(distributed.local(param).numel()), device=param.device)}


def convert_state(state, role, dtype):
    """``state[role]`` (and its block maxima) in ``dtype``, from whatever format it was saved in; a
    DTensor's local shard is converted (its block maxima are the shard's)."""
    value = torch.as_tensor(state[role])
    if distributed.is_dtensor(value):
        converted = convert_state(state | {role: value.to_local()}, role, dtype)
        return converted | {role: distributed.like(converted[role], value)}
    absmax = state.get(role + ABSMAX)
    if value.dtype == torch.uint8:
        if absmax is None:
            raise ValueError(f"state '{role}' holds 8-bit codes without its '{role}{ABSMAX}'")
        value = blockwise8.dequantize(value, torch.as_tensor(absmax).float(), blockwise8.codes_for(role))
    converted = {key: value for key, value in state.items() if key != role + ABSMAX}
    if dtype == torch.uint8:
        codes, absmax = blockwise8.quantize(value.float(), blockwise8.codes_for(role))
        return converted | {role: codes, role + ABSMAX: absmax}
    return converted | {role: value}


ABSMAX = "_absmax"  # the key suffix of an 8-bit state's block maxima
# Options that say how a step runs, not what it computes: a loaded state dict leaves them as they are.
EXECUTION_OPTIONS = ("foreach", "fused", "state_bits", "capturable", "differentiable")


def group_lr(group):
    """The group's lr as the step reads it: a number, or a 0-d view of a one-element tensor (which
    a scheduler may change in place)."""
    lr = group["lr"]
    return lr.view(()) if isinstance(lr, Tensor) else lr


def overlaps_itself(tensor):
    """Whether two elements of ``tensor`` may share memory (an expanded, stride-0 view, say): its
    dimensions, ordered by stride, must each step past everything the smaller ones reach."""
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_params(params, name):
    """Refuse a param listed twice or one that overlaps itself: an update would be applied twice to
    the same memory (from two threads, in the fused engines)."""
    if len(set(map(id, params))) != len(params):
        raise ValueError(f"{name}: a parameter appears twice in its param group; list each parameter once")
    for param in params:
        if overlaps_itself(distributed.local(param)):
            raise ValueError(f"{name}: a parameter of shape {tuple(param.shape)} with strides {param.stride()} "
                             "overlaps itself (an expanded view?), so its elements cannot be updated one by "
                             "one; optimize a tensor that owns its memory (.clone())")


SHAPE, STRIDES, DTYPE, DEVICE = attrgetter("shape"), Tensor.stride, attrgetter("dtype"), attrgetter("device")
LAYOUT = (Tensor.data_ptr, SHAPE, STRIDES, DTYPE, DEVICE)


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


class GroupWork:
    """What a step of one group needs of its params that have grads: the params, their (device,
    dtype) buckets, their states and state tensors by role, what ``_prepare_states`` made of the
    states (``context``) and the engines' caches per bucket (the fused engine's pointer tables).

    It is reused while the params and their states pass :class:`Signature`'s rule: the same params
    have grads, the params' state dicts hold the very tensors it was built on under every key (a
    user may clear or replace them between steps), and none of them has moved to new storage or
    changed its layout. Checking that is most of what a step costs in Python. The gradients are
    never kept: they are checked and listed afresh every step.
    """

    def __init__(self, roles, engine, params, local_params, signature=None):
        self.roles, self.engine, self.params, self.signature = roles, engine, params, signature
        self.local_params = local_params  # what the engines update: the params, or DTensors' local shards
        self.sharded = local_params is not params
        # the per-tensor scalars (step sizes, bias corrections): float64 where a param's math is float64
        self.scalar_dtype = torch.float64 if any(p.dtype == torch.float64 for p in local_params) else torch.float32
        self.buckets = [(bucket, None) for bucket in buckets(params)]
        self.states = self.kept = self.tensors = self.context = self.state_bits = self.state_signature = None
        self.bucket_caches = {}

    def fits(self, roles, engine, params, local_params):
        return (roles, engine) == (self.roles, self.engine) and self.signature.describes(params, local_params)

    def holds(self, states):
        """Whether ``states`` (the params' state dicts now) are those this work was built on,
        holding the same tensors under every key, each where and as it was."""
        return (self.states is not None and all(map(operator.is_, states, self.states))
                and all(all(map(operator.is_, map(dict.get, states, repeat(key)), tensors))
                        for key, tensors in self.kept.items())
                and self.state_signature.matches(self._local_states(), *LAYOUT))

    def _local_states(self):
        """The state tensors this work was built on (their local shards where the params are DTensors)."""
        return list(map(distributed.local, self.state_owners)) if self.sharded else self.state_owners

    def use_states(self, states, context, partitions, reduced_roles, group):
        """Take the states (every role present), with the subset-norm partition of each param (None:
        dense): the tensors of a partitioned param are handed to the engines in its (a, b, c) view.
        Params whose subsets span FSDP2 shards get buckets of their own, which sum over ``group``."""
        self.states, self.context, self.bucket_caches = states, context, {}
        self.kept = {key: list(map(dict.get, states, repeat(key))) for key in {key for state in states for key in state}}
        self.state_owners = [t for tensors in self.kept.values() for t in tensors if isinstance(t, Tensor)]
        if self.signature is not None:  # a cached entry (not one traced by torch.compile, which reuses nothing)
            self.state_signature = Signature(self.state_owners, self._local_states())
        self.partitions = partitions if any(partitions) else None
        self.tensors = {"param": self.local_params} | {role: list(map(distributed.local, self.kept[role]))
                                                       for role in self.roles}
        self.absmax = {role: self.kept[role + ABSMAX] for role in self.roles if role + ABSMAX in self.kept}
        spanning = {i for i, (param, part) in enumerate(zip(self.params, partitions))
                    if part is not None and distributed.spans_shards(param, part)}
        self.buckets = [(part, reduce) for bucket in buckets(self.params)
                        for part, reduce in (([i for i in bucket if i not in spanning], None),
                                             ([i for i in bucket if i in spanning], group)) if part]
        if self.partitions:
            self.tensors = {role: [t if part is None else part.view_state(t) if role in reduced_roles
                                   else part.view_param(t) for t, part in zip(tensors, partitions)]
                            for role, tensors in self.tensors.items()}

    def viewed(self, grads):
        """This step's grads, in their params' views."""
        if self.partitions is None:
            return grads
        return [grad if part is None else part.view_param(grad) for grad, part in zip(grads, self.partitions)]


class FastOptimizer(torch.optim.Optimizer):
    n_betas: int
    spec: KernelSpec  # its state roles, and what its fused kernels take

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
            for param in group["params"]:
                if param.is_complex():
                    raise ValueError(f"{type(self).__name__} does not support complex parameters; "
                                     "optimize torch.view_as_real(param) instead")
            devices = {param.device for param in group["params"]}
            if len(devices) > 1:
                raise ValueError(f"all params of a group must be on one device, got {sorted(map(str, devices))}")
            if isinstance(group["lr"], Tensor) and devices:
                check_tensor_lr(group["lr"], devices.pop())
            self._find_reduce_group()
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group, max_grad_norm=None):
        check_hyperparameters(group, self.n_betas)
        if group.get("sn") and not self.spec.reduced:
            raise ValueError(f"Invalid sn: {type(self).__name__} keeps no second moment, so sn does not apply")
        if group["max_grad_norm"] != (self.defaults["max_grad_norm"] if max_grad_norm is None else max_grad_norm):
            raise ValueError("Invalid max_grad_norm: it clips by the norm over all groups, "
                             "so set it in the constructor, not per group")
        engines.engine_name(group["foreach"], group["fused"])

    def _find_reduce_group(self):
        """The group of this optimizer's global reductions (see fastoptim.distributed), and whether its
        params are DTensors, whose local shards the engines update."""
        params = [param for group in self.param_groups for param in group["params"]]
        self._reduce_group = distributed.reduction_group(params, self.shard_group)
        self._sharded = any(distributed.is_dtensor(param) for param in params)

    def __getstate__(self):  # a copy keeps shard_group, or fails loudly where a group cannot be copied
        return super().__getstate__() | {"shard_group": self.shard_group}

    def __setstate__(self, state):
        declared = "differentiable" in self.__dict__.get("defaults", state.get("defaults", {}))
        super().__setstate__(state)
        if not declared:  # torch adds it to defaults; an optimizer that does not take it keeps it out of its groups
            self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("shard_group", None)
        self._find_reduce_group()

    # --- step -----------------------------------------------------------------------------------

    # GradScaler hands its scale and found_inf to step() (as attributes) instead of unscaling the
    # grads itself: the fused kernels consume them in the same pass, with no host sync.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        Every group is checked before anything changes, so a step that raises changes nothing."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        caches = self.__dict__.setdefault("_engine_caches", {})
        work = [(group, *self._group_work(caches, index, group)) for index, group in enumerate(self.param_groups)]
        amp_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        # Only the fused engines skip an inf step on the device. The others (the loop engine of
        # subsets that span shards included) look at found_inf, and so does a step that would
        # create states: a skipped step must leave no trace.
        if found_inf is not None and any(
                entry.params and (entry.engine not in engines.FUSED or entry.states is None
                                  or any(reduce for _, reduce in entry.buckets)) for _, entry, _ in work):
            if found_inf.item():
                return loss
            found_inf = None
        increment = 1 if found_inf is None else (found_inf == 0).float()  # a skipped step does not count
        inv_scale = None if amp_scale is None else amp_scale.double().reciprocal().float()
        max_norm = self.defaults["max_grad_norm"]
        all_grads = [grad for _, _, grads in work for grad in grads]
        clip = None
        if max_norm > 0 and (all_grads or self._reduce_group is not None):  # each rank joins the reduction
            # official Adan takes eps for the clip from the last group; without one, torch's clip_grad_norm_'s
            clip = clip_coefficient(all_grads, max_norm, self.param_groups[-1].get("eps", 1e-6), inv_scale, self._reduce_group)
        for group, entry, grads in work:
            if entry.params:
                self._step_group(group, entry, grads, self._grad_scale(group, clip, inv_scale), found_inf, increment)
            self._count_step(group, entry, increment)
        return loss

    def _group_work(self, caches, index, group):
        """The group's :class:`GroupWork` and its params' grads (local shards of DTensors), all
        checked; nothing is changed."""
        params = [param for param in group["params"] if param.grad is not None]
        grads = [param.grad for param in params]
        local_params = params
        if self._sharded:
            local_params, grads = list(map(distributed.local, params)), list(map(distributed.local, grads))
        roles = self.spec.kept(self.kernel_flags(group))
        engine = engines.engine_name(group["foreach"], group["fused"])
        if isinstance(group["lr"], Tensor) and params:  # a scheduler or the user may have set it since
            check_tensor_lr(group["lr"], params[0].device)
        if torch.compiler.is_compiling():  # traced once, so nothing to reuse; data pointers do not trace
            self._check_grads(local_params, grads)
            return GroupWork(roles, engine, params, local_params), grads
        entry = caches.get(index)
        if entry is None or not entry.fits(roles, engine, params, local_params):
            check_params(params, type(self).__name__)  # a param's storage may have changed since it was added
            entry = caches[index] = GroupWork(roles, engine, params, local_params, Signature(params, local_params))
        self._check_grads(local_params, grads, entry.signature)
        states = list(map(self.state.get, params))
        if not entry.holds(states) or entry.state_bits != group["state_bits"]:
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
        for key, expected in self._expected_state(group, param, state).items():
            value = state.get(key)
            if expected is None:  # a partition record, checked above
                continue
            shape, dtype = expected
            if value is not None and (value.shape != shape or value.dtype != dtype or value.device != param.device):
                raise RuntimeError(
                    f"{type(self).__name__}: state '{key}' is {value.dtype} {tuple(value.shape)} on {value.device}, "
                    f"but its param ({param.dtype} {tuple(param.shape)} on {param.device}) needs {dtype} "
                    f"{tuple(shape)}: was the param (or state_bits) changed after its state was created? Convert "
                    "the state (a state dict round trip does), or clear it with optimizer.state[param].clear()")

    def _step_group(self, group, entry, grads, grad_scale, found_inf, increment):
        if entry.states is None:  # every group is checked by now: states may be created
            states, context = self._prepare_states(entry.params, group)
            partitions = [subset_norm.from_record(p.shape, s) for p, s in zip(entry.params, states)]
            entry.use_states(states, context, partitions, self.spec.reduced, self._reduce_group)
            entry.state_bits = group["state_bits"]  # the states' format: checked again if the option changes
        args, per_tensor = self._step_arguments(group, entry, grad_scale, increment)
        plan = engines.Plan(entry.tensors | {"grad": entry.viewed(grads)}, self.update, self.spec,
                            getattr(self, "kernel_scalars", None), self.kernel_flags(group), args, frozenset(per_tensor),
                            found_inf, group["stochastic_rounding"], warn_fallback=group["fused"] is True,
                            absmax=entry.absmax)
        for index, (bucket, reduce_group) in enumerate(entry.buckets):
            part = plan if len(bucket) == len(entry.params) else plan.subset(bucket)
            part.cache = entry.bucket_caches.setdefault(index, {})
            if reduce_group is None:
                engines.ENGINES[entry.engine](part)
            else:
                engines.run_summing_over(part, reduce_group)

    def _partition(self, param, state, group):
        """The subset-norm partition of a param: the one its state records; for a state without a
        second moment yet, the group's (``sn``, ``subset_size``); None: a dense second moment."""
        if any(key in state for key in (*subset_norm.RECORDS, *self.spec.reduced)):
            return subset_norm.from_record(param.shape, state)
        return subset_norm.from_options(param.shape, group.get("subset_size")) if group.get("sn") else None

    def _ensure_state(self, param, group):
        """The param's state with every role of the group present: missing ones are zeros in their
        format, second moments in the param's partition (recorded in the state when it is new)."""
        state = self.state[param]
        partition = self._partition(param, state, group)
        if partition is not None:
            state.update(partition.record)
        for key, expected in self._expected_state(group, param, state).items():
            if expected is not None and key not in state and not key.endswith(ABSMAX):
                state.update(new_state(param, *expected, key, partition))
        return state

    def _expected_state(self, group, param, state):
        """The (shape, dtype) of each state tensor that a param's state must have (None for a
        partition record), the block maxima of 8-bit ones included."""
        partition = self._partition(param, state, group)
        expected = {key: None for key in subset_norm.RECORDS if key in state}
        for role in self.spec.kept(self.kernel_flags(group)):
            reduced = partition is not None and role in self.spec.reduced
            shape = partition.state_shape if reduced else param.shape
            dtype = state_dtype(param, role, group["state_bits"], reduced, self.spec.half)
            expected[role] = (shape, dtype)
            if dtype == torch.uint8:  # param-shaped: its blocks are the local shard's
                expected[role + ABSMAX] = (torch.Size([blockwise8.n_blocks(distributed.local(param).numel())]),
                                           torch.float32)
        return expected

    def _prepare_states(self, params, group):
        """The state dicts of a group's params with grads, with missing states created, and what
        ``_step_arguments`` reads of them as ``entry.context``. Called when they change, not every step."""
        return [self._ensure_state(param, group) for param in params], None

    @staticmethod
    def kernel_flags(group):
        """Hook: the spec's feature flags (name: bool) that ``group``'s options set."""
        return {}

    def _count_step(self, group, entry, increment):
        """Hook: advance the step counts by ``increment`` (1, or 0 on a step GradScaler skipped),
        after the update, for every group, whether or not its params had grads."""

    def _grad_scale(self, group, clip, inv_scale):
        """What the gradient is multiplied by: the clip coefficient, GradScaler's 1/scale, and −1
        to maximize; None for 1."""
        scale = clip if inv_scale is None else inv_scale if clip is None else clip * inv_scale
        if group["maximize"]:
            return -1.0 if scale is None else -scale
        return scale

    def _forget_engine_caches(self):
        """Drop the step work and pointer tables, which hold the states: for when states are replaced."""
        self.__dict__.pop("_engine_caches", None)

    # --- state dicts ----------------------------------------------------------------------------

    def state_dict(self):
        """torch's, except that the 8-bit states of DTensor params come dequantized, as fp32 DTensors:
        their blocks are per local shard, so only their values can be resharded. Loading quantizes
        them again, into the very codes and block maxima on the same shards."""
        state_dict = super().state_dict()
        if self._sharded:
            for key, state in state_dict["state"].items():
                for role in [role for role in state if role + ABSMAX in state]:
                    state = convert_state(state, role, torch.float32)
                state_dict["state"][key] = state
        return state_dict

    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of its peers' layout (see the class docstring).

        As in torch, the load pre-hooks see the dict first (and may replace it), and the post-hooks
        run last. Everything is checked before anything changes. The hyperparameters are the saved
        ones, ``max_grad_norm`` included (the saved groups must agree on it), but the execution
        options (``foreach``, ``fused``, ``state_bits``, and AdamW's ``capturable`` and
        ``differentiable``) stay this optimizer's: a state moves freely between engines, and is
        converted to this optimizer's state format (quantized, or dequantized). States are on the
        parameter's device (float64 for a float64 parameter), whatever the saved device. A state of
        this algorithm that the saved options leave unused (``max_exp_avg_sq`` after amsgrad was
        turned off) is kept as it was saved, as torch keeps it.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        groups, saved_groups = self.param_groups, deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups) or any(
                len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict does not match the optimizer's parameter groups: "
                             f"{[len(s['params']) for s in saved_groups]} params saved, "
                             f"{[len(g['params']) for g in groups]} here")
        # max_grad_norm is global: the saved one is taken, as torch takes the other hyperparameters
        max_grad_norms = {saved.get("max_grad_norm", self.defaults["max_grad_norm"]) for saved in saved_groups}
        if len(max_grad_norms) > 1:
            raise ValueError(f"loaded param groups disagree on max_grad_norm ({sorted(max_grad_norms)}), "
                             "which clips by the norm over all groups")
        max_grad_norm = max_grad_norms.pop() if max_grad_norms else self.defaults["max_grad_norm"]
        own_options = [key for key in EXECUTION_OPTIONS if key in self.defaults]
        new_groups, new_state = [], {}
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            merged = {**self.defaults, "max_grad_norm": max_grad_norm, **saved,
                      **{key: group[key] for key in own_options}, "params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                merged["param_names"] = group["param_names"]
            try:
                normalize_betas(merged)
                self._check_group(merged, max_grad_norm)
                self._convert_saved_group(merged)
            except ValueError as error:
                raise ValueError(f"loaded param group {index}: {error}. Is it a state dict of another "
                                 f"optimizer? {type(self).__name__} expects {self.n_betas} betas.") from None
            for saved_id, param in zip(saved["params"], group["params"]):
                if saved_id in state_dict["state"]:
                    new_state[param] = self._load_state(dict(state_dict["state"][saved_id]), merged, param, saved_id)
            new_groups.append(merged)
        self.__setstate__({"state": defaultdict(dict, new_state), "param_groups": new_groups})
        self.defaults["max_grad_norm"] = max_grad_norm
        self._forget_engine_caches()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state(self, state, group, param, saved_id):
        """One saved per-parameter state, checked and converted into this optimizer's formats, on
        ``param``'s device."""
        try:
            subset_norm.check_record(param.shape, state)
        except ValueError as error:
            raise ValueError(f"state of parameter {saved_id}: {error}") from None
        expected = self._expected_state(group, param, state)
        for key in set(state) & set(expected):  # into this optimizer's formats (state_bits)
            if expected[key] is not None and not key.endswith(ABSMAX):
                try:
                    state = convert_state(state, key, expected[key][1])
                except (ValueError, RuntimeError) as error:
                    raise ValueError(f"state of parameter {saved_id}: {error}") from None
        unused = {key for role in self.spec.states for key in (role, role + ABSMAX)} - set(expected)
        if set(state) - set(expected) - unused or set(expected) - set(state) - self.spec.optional:
            raise ValueError(
                f"state of parameter {saved_id} has keys {sorted(state)}, but {type(self).__name__} "
                f"expects {sorted(expected)}: is it a state dict of another optimizer?")
        for key in state:
            if key not in expected:  # a state the saved options leave unused: kept as saved
                state[key] = torch.as_tensor(state[key]).to(param.device, copy=True)
                continue
            if expected[key] is None:  # a partition record: a Python int
                continue
            (shape, dtype), value = expected[key], torch.as_tensor(state[key])
            if value.shape != shape:
                raise ValueError(f"state '{key}' of parameter {saved_id} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(shape)}")
            if key in self.spec.kept(self.kernel_flags(group)) and distributed.is_dtensor(param) and not distributed.is_dtensor(value):
                raise ValueError(f"state '{key}' of parameter {saved_id} is a plain tensor, but its param "
                                 "is a DTensor: load sharded states through torch.distributed.checkpoint "
                                 "(see the README)")
            state[key] = value.to(device=param.device, dtype=dtype, copy=True)
        return state

    def _convert_saved_group(self, group):
        """Bring a saved param group into this optimizer's layout, in place; a ValueError if it cannot."""
