"""Adan: Adaptive Nesterov Momentum (Xie et al., 2022), exactly as official sail-sg/Adan computes it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..specs import KernelSpec, Role
from ..engines.ops import sqrt
from .base import FastOptimizer, count_after, group_lr, in_dtype

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SPEC = KernelSpec(
    "adan",
    roles=(Role("exp_avg"), Role("exp_avg_sq", signed=False, reduced=True), Role("exp_avg_diff"),
           # g_prev is subtracted from g: 8-bit codes would put their 1/16 error into every difference;
           # step 1 does not read it
           Role("neg_pre_grad", half=True, optional=True)),
    scalars=("beta1", "beta2", "beta3", "one_minus_beta1", "one_minus_beta2", "one_minus_beta3", "eps",
             "pre_grad_weight", "bias_correction3_sqrt", "step_size", "diff_ratio", "decay_mul", "decay_div"))


def adan_update(ops, *, param, grad, scratch, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad,
                beta1, beta2, beta3, eps, lr, weight_decay, no_prox, grad_scale, pre_grad_weight,
                bias_correction3_sqrt, step_size, diff_ratio):
    """One Adan step; betas follow the official code's convention (1 − the paper's)::

        g      = grad · grad_scale           (the clip coefficient, negated to maximize; None: 1)
        d      = w·(g − g_prev)              (w = pre_grad_weight: 0 at a param's first step, where
                                              official Adan sets g_prev = g; then 1)
        m      = β1·m + (1−β1)·g             exp_avg
        v      = β2·v + (1−β2)·d             exp_avg_diff
        n      = β3·n + (1−β3)·Σ_S (g + β2·d)²   exp_avg_sq: one entry per subset S of the param's
                                              elements under ``sn`` (see fastoptim.states.subset_norm),
                                              else per element (S = {i})
        denom  = √n / √(1−β3^t) + eps        (n broadcast over its subset)
        update = step_size·(m + diff_ratio·v)/denom,
                 step_size = lr/(1−β1^t), diff_ratio = β2·(1−β1^t)/(1−β2^t)
        p      = (p − update) / (1 + lr·wd)  proximal (default)
        p      = p·(1 − lr·wd) − update      no_prox

    ``neg_pre_grad`` holds −g_prev between steps; within one it holds d, then g + β2·d.
    """
    ops.copy_(scratch, grad)
    ops.mul_(scratch, -1.0 if grad_scale is None else -grad_scale)  # scratch = −g
    ops.sub_(neg_pre_grad, scratch)
    ops.mul_(neg_pre_grad, pre_grad_weight)  # d
    ops.mul_(exp_avg, beta1)
    ops.sub_(exp_avg, scratch, alpha=1 - beta1)
    ops.mul_(exp_avg_diff, beta2)
    ops.add_(exp_avg_diff, neg_pre_grad, alpha=1 - beta2)
    ops.mul_(neg_pre_grad, beta2)
    ops.sub_(neg_pre_grad, scratch)  # g + β2·d
    ops.mul_(exp_avg_sq, beta3)
    ops.add_squares_(exp_avg_sq, neg_pre_grad, value=1 - beta3)
    ops.copy_(neg_pre_grad, scratch)  # −g, for the next step

    ops.copy_(scratch, exp_avg_sq)
    ops.sqrt_(scratch)
    ops.div_(scratch, bias_correction3_sqrt)
    ops.add_(scratch, eps)
    ops.reciprocal_(scratch)  # 1/denom
    if weight_decay and no_prox:
        ops.mul_(param, 1 - lr * weight_decay)
    ops.mul_(scratch, step_size)
    ops.addcmul_(param, exp_avg, scratch, value=-1)
    ops.mul_(scratch, diff_ratio)
    ops.addcmul_(param, exp_avg_diff, scratch, value=-1)
    if weight_decay and not no_prox:
        ops.div_(param, 1 + lr * weight_decay)


class Adan(FastOptimizer):
    """Adan, computing exactly what official sail-sg/Adan computes (see
    [adan_update][fastoptim.optimizers.adan.adan_update]).

    Args:
        params: parameters or param groups (dicts with per-group options).
        lr: learning rate, a float or a 0-d tensor.
        betas: (β1, β2, β3) in the official code's convention, 1 − the paper's.
        eps: added to the denominator after the square root.
        weight_decay: proximal by default, decoupled (AdamW-like) with ``no_prox=True``.
        no_prox: decoupled weight decay ``p·(1 − lr·wd) − update`` instead of ``(p − update)/(1 + lr·wd)``.
        sn: (usually set per group) keep ``exp_avg_sq`` per subset of each param's elements, fed
            with Σ_S (g + β2·d)² (subset-norm Adan): O(√d) entries for a d-element matrix.
        subset_size: the partition under ``sn``: None for rows or columns of 2-D params (the other
            shapes per element), k > 0 or -k for flattened subsets (see fastoptim.states.subset_norm).
        (the arguments of every fastoptim optimizer)

    Under ``state_bits=8``, ``neg_pre_grad`` is kept in bf16 (it is subtracted from the next
    gradient, so 8-bit codes would put their error into every difference), and a subset-norm
    ``exp_avg_sq`` stays fp32. The clip's eps is the last group's, as official Adan's.

    State: per parameter ``exp_avg``, ``exp_avg_sq``, ``exp_avg_diff`` and ``neg_pre_grad`` (fp32, the
    official and timm keys; under ``sn``, ``exp_avg_sq`` has the partition's shape and the state
    records the partition as ``reduce_dim`` or ``subset_size``); the step count is ``group['step']``,
    a 0-d fp32 tensor made with the group. State dicts of official Adan and timm's Adan (integer
    ``step``) load and resume on the same trajectory.
    """

    n_betas = 3
    update = staticmethod(adan_update)
    spec = SPEC

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3,
                 betas: tuple[float, float, float] = (0.98, 0.92, 0.99), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, no_prox: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, *, maximize: bool = False,
                 stochastic_rounding: bool = False, master_bits: int = 16, sn: bool = False,
                 subset_size: int | None = None, state_bits: int = 32, shard_group: ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        no_prox=no_prox, foreach=foreach, fused=fused, maximize=maximize,
                        stochastic_rounding=stochastic_rounding, master_bits=master_bits, sn=sn,
                        subset_size=subset_size, state_bits=state_bits)
        super().__init__(params, defaults, shard_group)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._group_step(self.param_groups[-1])  # now, not at the first step: a compiled step must find it

    @torch.no_grad()
    def restart_opt(self) -> None:
        """Restart as the official code does: step 0, zero moments, and the next gradient is g_prev."""
        for group in self.param_groups:
            group["step"] = torch.zeros_like(self._group_step(group))
            for param in group["params"]:
                if param.requires_grad:
                    self.state[param].clear()
        self._forget_engine_caches()

    def _prepare_states(self, params, group):
        """The states, and as ``context`` the weights of g − g_prev for the step that creates them:
        0 for a param without ``neg_pre_grad`` (its first step, whenever it comes), 1 for the others.
        Official Adan sets g_prev = g when ``neg_pre_grad`` is missing or the step count is 1."""
        weights = [float("neg_pre_grad" in self.state.get(param, ())) for param in params]
        states, _ = super()._prepare_states(params, group)
        return states, torch.tensor(weights, device=params[0].device) if 0.0 in weights else None

    def _step_arguments(self, group, entry, grad_scale, increment):
        first_step_weights, entry.context = entry.context, None  # for one step: then every param has a g_prev
        lr, wide = group_lr(group), entry.scalar_dtype
        t = count_after(self._group_step(group), increment, lr)  # float64: 1 − β^t in fp32 would lose digits
        pre_grad_weight = 1.0 * (t > 1) if first_step_weights is None else (t > 1) * first_step_weights
        if first_step_weights is not None and torch.compiler.is_compiling():
            # a compiled step reads the weights again on every call: a step that counts gives every param a g_prev
            first_step_weights.clamp_(min=increment)
        beta1, beta2, beta3 = group["betas"]
        args = dict(beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"], lr=lr,
                    weight_decay=group["weight_decay"], no_prox=group["no_prox"], grad_scale=grad_scale,
                    pre_grad_weight=pre_grad_weight, bias_correction3_sqrt=in_dtype(sqrt(1 - beta3**t), wide),
                    step_size=in_dtype(lr / (1 - beta1**t), wide),
                    diff_ratio=in_dtype(beta2 * (1 - beta1**t) / (1 - beta2**t), wide))
        return args, () if first_step_weights is None else {"pre_grad_weight"}

    def _count_step(self, group, entry, increment):
        """The step count is the group's, and it advances whether or not any param had a grad, as
        in official Adan."""
        self._group_step(group).add_(increment)

    @staticmethod
    def _group_step(group):
        if "step" not in group:
            device = group["params"][0].device if group["params"] else None
            group["step"] = torch.zeros((), dtype=torch.float32, device=device)
        return group["step"]

    @staticmethod
    def kernel_scalars(args):
        """``adan_update``'s arguments as the fused kernels take them: weight decay as a factor
        before the update and a divisor after it (1 where it does not apply)."""
        decay = args["lr"] * args["weight_decay"]
        return {name: args[name] for name in ("beta1", "beta2", "beta3", "eps", "pre_grad_weight",
                                               "bias_correction3_sqrt", "step_size", "diff_ratio")} | dict(
            one_minus_beta1=1 - args["beta1"], one_minus_beta2=1 - args["beta2"], one_minus_beta3=1 - args["beta3"],
            grad_scale=1.0 if args["grad_scale"] is None else args["grad_scale"],
            decay_mul=1 - decay if args["no_prox"] else 1.0, decay_div=1.0 if args["no_prox"] else 1 + decay)

    def _convert_saved_group(self, group):
        step = group.get("step", 0)  # official and timm keep an integer, and none before their first step
        if isinstance(step, bool) or not isinstance(step, (int, float, torch.Tensor)) or torch.as_tensor(step).dim():
            raise ValueError(f"Invalid step: {step!r} (must be a number or a 0-d tensor)")
        step = torch.as_tensor(step, dtype=torch.float32)
        if not (step >= 0 and step == step.floor() and step.isfinite()):
            raise ValueError(f"Invalid step: {step.item()!r} (must be a whole number >= 0)")
        device = group["params"][0].device if group["params"] else None
        group["step"] = step.to(device=device, copy=True)

