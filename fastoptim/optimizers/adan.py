"""Adan: Adaptive Nesterov Momentum (Xie et al., 2022), exactly as official sail-sg/Adan computes it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..specs import KernelSpec, Role
from ..engines.ops import sqrt
from .algorithm import PER_GROUP, Algorithm, StepInputs, decays
from .base import FastOptimizer, in_dtype
from .step_counts import group_count

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SPEC = KernelSpec(
    "adan",
    roles=(Role("exp_avg"), Role("exp_avg_sq", codes="unsigned", reduced=True), Role("exp_avg_diff"),
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
    # m − (1−β1)·(−g), as torch's sub_ computes it (an add of the negated alpha), whose traced
    # decomposition takes an alpha that a tensor β1 holds, where sub's compares it with 1 on the host
    ops.add_(exp_avg, scratch, alpha=-(1 - beta1))
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
    if decays(weight_decay) and no_prox:
        ops.mul_(param, 1 - lr * weight_decay)
    ops.mul_(scratch, step_size)
    ops.addcmul_(param, exp_avg, scratch, value=-1)
    ops.mul_(scratch, diff_ratio)
    ops.addcmul_(param, exp_avg_diff, scratch, value=-1)
    if decays(weight_decay) and not no_prox:
        ops.div_(param, 1 + lr * weight_decay)


def adan_arguments(group: dict, inputs: StepInputs) -> tuple[dict, set[str]]:
    """``adan_update``'s arguments for a step of Adan: the bias corrections of the group's count, and
    the weight of g − g_prev, 0 at a param's first step (official Adan sets g_prev = g when
    ``neg_pre_grad`` is missing or the count is 1)."""
    t, lr, wide, first_reads = inputs.count, inputs.lr, inputs.wide, inputs.first_reads
    beta1, beta2, beta3 = group["betas"]
    args = dict(beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"], lr=lr, weight_decay=group["weight_decay"],
                no_prox=group["no_prox"], grad_scale=inputs.grad_scale,
                pre_grad_weight=1.0 * (t > 1) if first_reads is None else (t > 1) * first_reads,
                bias_correction3_sqrt=in_dtype(sqrt(1 - beta3**t), wide), step_size=in_dtype(lr / (1 - beta1**t), wide),
                diff_ratio=in_dtype(beta2 * (1 - beta1**t) / (1 - beta2**t), wide))
    return args, set() if first_reads is None else {"pre_grad_weight"}


def adan_kernel_scalars(args: dict) -> dict:
    """``adan_update``'s arguments as the fused kernels take them: weight decay as a factor before
    the update and a divisor after it (1 where it does not apply)."""
    decay = args["lr"] * args["weight_decay"]
    return {name: args[name] for name in ("beta1", "beta2", "beta3", "eps", "pre_grad_weight",
                                           "bias_correction3_sqrt", "step_size", "diff_ratio")} | dict(
        one_minus_beta1=1 - args["beta1"], one_minus_beta2=1 - args["beta2"], one_minus_beta3=1 - args["beta3"],
        grad_scale=1.0 if args["grad_scale"] is None else args["grad_scale"],
        decay_mul=1 - decay if args["no_prox"] else 1.0, decay_div=1.0 if args["no_prox"] else 1 + decay)


ADAN = Algorithm(SPEC, adan_update, adan_arguments, adan_kernel_scalars, counts=PER_GROUP, n_betas=3,
                 rule=("adan", ("lr", "betas", "eps", "weight_decay", "no_prox")))


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

    algorithm = ADAN

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

    @torch.no_grad()
    def restart_opt(self) -> None:
        """Restart as the official code does: step 0, zero moments, and the next gradient is g_prev."""
        for group in self.param_groups:
            group["step"] = torch.zeros_like(group_count(group))
            for param in group["params"]:
                if param.requires_grad:
                    self.state[param].clear()
        self._forget_plans()
