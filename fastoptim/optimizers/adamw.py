"""AdamW (Loshchilov & Hutter), with the same signature, results and state dict as torch.optim.AdamW."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..engines.ops import sqrt
from ..specs import KernelSpec, Role
from .algorithm import PER_PARAM, Algorithm, StepInputs, decays
from .base import FastOptimizer, in_dtype

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SPEC = KernelSpec(  # AdamW's family: AdamWSN and RMSPropSN take it too
    "adamw",
    roles=(Role("exp_avg", when="first_moment"), Role("exp_avg_sq", codes="unsigned", reduced=True),
           Role("max_exp_avg_sq", codes="unsigned", reduced=True, when="amsgrad")),
    scalars=("one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay_mul", "decay_after", "step_size",
             "bias_correction2_sqrt"),
    flags=("amsgrad", "first_moment"))


def adamw_update(ops, *, param, grad, scratch, exp_avg=None, exp_avg_sq, max_exp_avg_sq=None, beta1, beta2, eps,
                 lr, weight_decay, grad_scale, step_size, bias_correction2_sqrt=None, decay_after=False):
    """One step of AdamW's family: AdamW as torch.optim.AdamW computes it, and AdamWSN/RMSPropSN as
    the seed's AdamwSN does (``decay_after``, no ``bias_correction2_sqrt``)::

        g     = grad · grad_scale          (−1 to maximize, times the clip coefficient; None: 1)
        p     = p·(1 − lr·wd)              before the update (AdamW)
        m     = β1·m + (1−β1)·g            exp_avg; without one (RMSPropSN, β1 = 0), m = g
        v     = β2·v + (1−β2)·Σ_S g²       exp_avg_sq: one entry per subset S under ``sn``
                                           (fastoptim.states.subset_norm), else per element
        v̂     = max(v̂, v) with amsgrad     max_exp_avg_sq (v̂ = v without it)
        p     = p − step_size · m / (√v̂ / bc + eps)   v̂ broadcast over its subset; AdamW:
                                           step_size = lr/(1−β1^t), bc = √(1−β2^t); AdamWSN:
                                           step_size = lr·√(1−β2^t)/(1−β1^t) (lr without
                                           correct_bias), bc = 1
        p     = p·(1 − lr·wd)              after the update, with ``decay_after`` (AdamWSN)
    """
    if grad_scale is not None:
        ops.copy_(scratch, grad)
        ops.mul_(scratch, grad_scale)
        grad = scratch
    if decays(weight_decay) and not decay_after:
        ops.mul_(param, 1 - lr * weight_decay)
    if exp_avg is not None:
        ops.lerp_(exp_avg, grad, 1 - beta1)
    ops.mul_(exp_avg_sq, beta2)
    ops.add_squares_(exp_avg_sq, grad, value=1 - beta2)
    if max_exp_avg_sq is not None:
        ops.maximum_(max_exp_avg_sq, exp_avg_sq)
    numerator = grad if exp_avg is None else exp_avg
    # The denominator takes the scratch unless RMSProp's numerator, a scaled grad, holds it (said
    # without `is` between lists, which dynamo before torch 2.13 cannot trace).
    scratch_taken = exp_avg is None and grad_scale is not None
    denominator = ops.empty_like(exp_avg_sq) if scratch_taken else scratch
    ops.copy_(denominator, exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq)
    ops.sqrt_(denominator)
    if bias_correction2_sqrt is not None:
        ops.div_(denominator, bias_correction2_sqrt)
    ops.add_(denominator, eps)
    ops.div_(denominator, step_size)
    ops.addcdiv_(param, numerator, denominator, value=-1)
    if decays(weight_decay) and decay_after:
        ops.mul_(param, 1 - lr * weight_decay)


def adamw_arguments(group: dict, inputs: StepInputs) -> tuple[dict, set[str]]:
    """``adamw_update``'s arguments for a step of AdamW: torch's bias corrections of each param's count."""
    beta1, beta2 = group["betas"]
    t, lr = inputs.count, inputs.lr
    args = dict(beta1=beta1, beta2=beta2, eps=group["eps"], lr=lr, weight_decay=group["weight_decay"],
                grad_scale=inputs.grad_scale, step_size=in_dtype(lr / (1 - beta1**t), inputs.wide),
                bias_correction2_sqrt=in_dtype(sqrt(1 - beta2**t), inputs.wide))
    return args, inputs.per_param({"step_size", "bias_correction2_sqrt"})


def adamw_kernel_scalars(args: dict) -> dict:
    """``adamw_update``'s arguments as the fused kernels take them: weight decay as a factor before
    the update or after it."""
    decay, after = 1 - args["lr"] * args["weight_decay"], args.get("decay_after", False)
    correction = args.get("bias_correction2_sqrt")
    return {name: args[name] for name in ("beta2", "eps", "step_size")} | dict(
        one_minus_beta1=1 - args["beta1"], one_minus_beta2=1 - args["beta2"],
        grad_scale=1.0 if args["grad_scale"] is None else args["grad_scale"],
        bias_correction2_sqrt=1.0 if correction is None else correction,
        decay_mul=1.0 if after else decay, decay_after=decay if after else 1.0)


ADAMW = Algorithm(SPEC, adamw_update, adamw_arguments, adamw_kernel_scalars,
                  fixed_flags=dict(first_moment=True), option_flags=lambda group: dict(amsgrad=group["amsgrad"]),
                  counts=PER_PARAM,
                  rule=("adamw", ("lr", "betas", "eps", "weight_decay")))


class AdamW(FastOptimizer):
    """AdamW with torch.optim.AdamW's signature and results (see
    [adamw_update][fastoptim.optimizers.adamw.adamw_update]).

    Args:
        params: parameters or param groups (dicts with per-group options).
        lr: learning rate, a float or a one-element tensor (which a scheduler may change in place).
        betas: (β1, β2), the decay rates of the first and second moments.
        eps: added to the denominator after the square root.
        weight_decay: decoupled: ``p·(1 − lr·wd)`` before the update.
        amsgrad: keep the running maximum of the second moment, ``max_exp_avg_sq``, as torch does.
        capturable: accepted for torch's signature; fastoptim's step is always capturable (step
            counts and a tensor lr stay on the params' device).
        differentiable: ``False`` only: the step runs without autograd and updates in place.
        sn: (usually set per group) keep the second moments per subset of each param's elements.
        subset_size: the partition under ``sn`` (see fastoptim.states.subset_norm).
        (the arguments of every fastoptim optimizer)

    State per parameter is torch's: ``step`` (0-d fp32 tensor), ``exp_avg``, ``exp_avg_sq`` and,
    with amsgrad, ``max_exp_avg_sq``; torch AdamW state dicts load as they are. float64 params keep
    float64 states and math.
    """

    algorithm = ADAMW

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, max_grad_norm: float = 0.0, stochastic_rounding: bool = False,
                 master_bits: int = 16, sn: bool = False, subset_size: int | None = None, state_bits: int = 32,
                 shard_group: ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        max_grad_norm=max_grad_norm, stochastic_rounding=stochastic_rounding, master_bits=master_bits,
                        sn=sn, subset_size=subset_size, state_bits=state_bits)
        super().__init__(params, defaults, shard_group)

    def _check_plan(self, group):
        super()._check_plan(group)  # so torch's options, written between steps, are checked there too
        # True changes nothing: fastoptim keeps step counts and a tensor lr on the params' device, and
        # its warmed-up fused step never waits for the device. torch.compile sets it on CUDA groups.
        if not isinstance(group["capturable"], bool):
            raise ValueError(f"Invalid capturable: {group['capturable']!r} (must be True or False)")
        if group["differentiable"] is not False:
            raise ValueError(f"Invalid differentiable: {group['differentiable']!r}: fastoptim's step runs "
                             "without autograd and updates in place; pass differentiable=False")
