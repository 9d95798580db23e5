"""What every fastoptim optimizer shares: the torch.optim contract, input validation, bucketing,
engine dispatch and state-dict conversion. A subclass states its algorithm: hyperparameters, state
layout, per-step scalars and ``update``, the math written once."""
import math
import operator

import numpy as np
import torch
from torch import Tensor

from .. import engines
from ..clip import clip_coefficient
from ..multi_tensor import buckets, data_pointers


def check_hyperparameters(group, n_betas):
    """Raise a ValueError that names the first invalid hyperparameter of ``group``."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"Invalid lr: a Tensor lr must be a floating-point scalar, got shape {tuple(lr.shape)}")
        lr = lr.item()  # construction time only, never in step()
    for name, value in (("lr", lr), ("eps", group["eps"]), ("weight_decay", group["weight_decay"]),
                        ("max_grad_norm", group["max_grad_norm"])):
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
    for flag in ("maximize", "stochastic_rounding"):
        if not isinstance(group[flag], bool):
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be True or False)")


def state_dtype(param):
    """States are fp32, whatever the param's dtype, except that a float64 param keeps float64
    states and math: rounding it through fp32 would change it."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


class GroupWork:
    """One group's step work: its params that have grads (validated against ``all_grads``, the
    group's grads when it was built), their (device, dtype) buckets, their states, the tensors by
    role, and what the optimizer's ``_prepare_states`` made of the states (``context``)."""

    def __init__(self, roles, engine):
        self.roles, self.engine = roles, engine
        self.all_grads, self.params, self.buckets, self.grad_pointers = [], [], [], None
        self.states = self.tensors = self.context = None


class FastOptimizer(torch.optim.Optimizer):
    n_betas: int

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            for param in group["params"]:
                if param.is_complex():
                    raise ValueError(f"{type(self).__name__} does not support complex parameters; "
                                     "optimize torch.view_as_real(param) instead")
            devices = {param.device for param in group["params"]}
            if len(devices) > 1:
                raise ValueError(f"all params of a group must be on one device, got {sorted(map(str, devices))}")
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group):
        check_hyperparameters(group, self.n_betas)
        if group["max_grad_norm"] != self.defaults["max_grad_norm"]:
            raise ValueError("Invalid max_grad_norm: it clips by the norm over all groups, "
                             "so set it in the constructor, not per group")
        engines.engine_name(group["foreach"], group["fused"])

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    # --- step -----------------------------------------------------------------------------------

    # GradScaler hands its scale and found_inf to step() (as attributes) instead of unscaling the
    # grads itself: the fused kernels consume them in the same pass, with no host sync.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        caches = self.__dict__.setdefault("_engine_caches", {})
        work = [(index, group, self._group_work(caches, index, group))  # validates every group first
                for index, group in enumerate(self.param_groups)]
        work = [(index, group, entry) for index, group, entry in work if entry.params]
        if not work:
            return loss
        amp_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found_inf is not None and any(entry.engine not in engines.FUSED for _, _, entry in work):
            if found_inf.item():  # the loop and foreach engines cannot skip without looking
                return loss
            found_inf = None
        inv_scale = None if amp_scale is None else amp_scale.double().reciprocal().float()
        max_norm = self.defaults["max_grad_norm"]
        clip = None
        if max_norm > 0:  # official Adan takes eps for the clip from the last group
            grads = [param.grad for _, _, entry in work for param in entry.params]
            clip = clip_coefficient(grads, max_norm, self.param_groups[-1]["eps"], inv_scale)
        for index, group, entry in work:
            self._step_group(caches, index, group, entry, self._grad_scale(group, clip, inv_scale), found_inf)
        return loss

    def _group_work(self, caches, index, group):
        """The group's params that have grads, validated, with their states and tensors by role.
        While the grads are the very tensors of the last step, that step's work is reused; while
        the same params have grads, their states and state lists are: checking 2000 tensors in
        Python costs more than updating them."""
        grads = [param.grad for param in group["params"]]
        roles = self._state_roles(group)
        engine = engines.engine_name(group["foreach"], group["fused"])
        if torch.compiler.is_compiling():  # traced once, so nothing to reuse; data pointers do not trace
            entry = GroupWork(roles, engine)
            entry.params = self._params_with_grad(group)
            entry.buckets = buckets(entry.params)
            return entry
        entry = caches.get(("work", index))
        if entry is None or (entry.roles, entry.engine) != (roles, engine):
            entry = caches[("work", index)] = GroupWork(roles, engine)
        # The same grad objects with the same storage (`grad.data = ...` and Module.to() keep the object).
        if (len(entry.all_grads) == len(grads) and all(map(operator.is_, grads, entry.all_grads))
                and np.array_equal(data_pointers([grad for grad in grads if grad is not None]), entry.grad_pointers)):
            return entry
        params = self._params_with_grad(group)
        if len(params) != len(entry.params) or not all(map(operator.is_, params, entry.params)):
            entry.params, entry.states = params, None
        entry.all_grads, entry.buckets = grads, buckets(params)
        entry.grad_pointers = data_pointers([param.grad for param in params])
        if entry.states is not None:
            entry.tensors = entry.tensors | {"grad": [param.grad for param in params]}
        return entry

    def _params_with_grad(self, group):
        params = [param for param in group["params"] if param.grad is not None]
        name = type(self).__name__
        for param in params:
            grad = param.grad
            if grad.layout != torch.strided:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
                raise RuntimeError(
                    f"{name}: a gradient must match its parameter; got grad {grad.dtype} {tuple(grad.shape)} "
                    f"on {grad.device} for param {param.dtype} {tuple(param.shape)} on {param.device}")
        if len({param.device for param in params}) > 1:
            raise RuntimeError(f"{name}: all params of a group must be on one device")
        return params

    def _step_group(self, caches, index, group, entry, grad_scale, found_inf):
        if entry.states is None:  # after validation of every group: now states may be created
            entry.states = [self._ensure_state(param, group) for param in entry.params]
            entry.context = self._prepare_states(entry.states)
            entry.tensors = {"param": entry.params, "grad": [param.grad for param in entry.params]}
            entry.tensors |= {role: [state[role] for state in entry.states] for role in entry.roles}
        increment = 1 if found_inf is None else 1 - found_inf  # a skipped step does not count
        args, per_tensor = self._step_arguments(group, entry, grad_scale, increment)
        plan = engines.Plan(entry.tensors, args, frozenset(per_tensor), found_inf, group["stochastic_rounding"],
                            warn_fallback=group["fused"] is True)
        for bucket in entry.buckets:
            part = plan if len(bucket) == len(entry.params) else plan.subset(bucket)
            first = entry.params[bucket[0]]
            part.cache = caches.setdefault((index, first.device, first.dtype), {})
            engines.AVAILABLE[entry.engine](self, part)

    def _prepare_states(self, states):
        """Hook: arrange the states of a group's params with grads once (not every step); the
        result is handed to ``_step_arguments`` as ``entry.context``."""
        return None

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

    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of its peers' layout (see the class docstring).

        Everything is checked before anything changes. The engine flags (``foreach``, ``fused``)
        stay this optimizer's, so a state moves freely between engines. States are fp32 tensors on
        the parameter's device (float64 for a float64 parameter), whatever the saved dtype.
        """
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
                len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict does not match the optimizer's parameter groups: "
                             f"{[len(s['params']) for s in saved_groups]} params saved, "
                             f"{[len(g['params']) for g in groups]} here")
        new_groups, new_state, sources = [], {}, {}
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            merged = {**self.defaults, **saved, "foreach": group["foreach"], "fused": group["fused"]}
            try:
                self._check_group(merged)
            except ValueError as error:
                raise ValueError(f"loaded param group {index}: {error}. Is it a state dict of another "
                                 f"optimizer? {type(self).__name__} expects {self.n_betas} betas.") from None
            device = group["params"][0].device
            self._convert_saved_group(merged, device)
            for saved_id, param in zip(saved["params"], group["params"]):
                if saved_id not in state_dict["state"]:
                    continue
                state = self._convert_saved_state(dict(state_dict["state"][saved_id]), merged)
                expected = self._expected_state(merged, param)
                if set(state) - set(expected) or set(expected) - set(state) - self.optional_state:
                    raise ValueError(
                        f"state of parameter {saved_id} has keys {sorted(state)}, but {type(self).__name__} "
                        f"expects {sorted(expected)}: is it a state dict of another optimizer?")
                for key in state:
                    shape, value = expected[key], torch.as_tensor(state[key])
                    if value.shape != shape:
                        raise ValueError(f"state '{key}' of parameter {saved_id} has shape {tuple(value.shape)}, "
                                         f"expected {tuple(shape)}")
                    dtype = torch.float32 if key == "step" else state_dtype(param)  # counts are fp32, as torch's
                    state[key] = value.to(device=param.device, dtype=dtype, copy=True)
                new_state[saved_id], sources[param] = state, state
            new_groups.append(merged)
        super().load_state_dict({"state": new_state, "param_groups": new_groups})
        self._forget_engine_caches()
        for param, state in sources.items():  # torch casts states to the param's dtype; keep ours
            self.state[param].update(state)

    def _convert_saved_group(self, group, device):
        """Bring a saved param group into this optimizer's layout, in place."""

    def _convert_saved_state(self, state, group):
        """Bring one saved per-parameter state into this optimizer's layout."""
        return state
