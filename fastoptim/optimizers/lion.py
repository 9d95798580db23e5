"""Lion: EvoLved Sign Momentum (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..specs import KernelSpec, Role
from .algorithm import Algorithm, StepInputs, decays
from .base import FastOptimizer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SPEC = KernelSpec("lion", roles=(Role("exp_avg"),),
                  scalars=("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "lr", "decay_mul"))


def lion_update(ops, *, param, grad, scratch, exp_avg, beta1, beta2, lr, weight_decay, grad_scale):
    """One Lion step, as the paper's Program 1 and timm's Lion compute it::

        g = grad · grad_scale            (the clip coefficient, −1 to maximize; None: 1)
        p = p·(1 − lr·wd)                decoupled weight decay
        p = p − lr·sign(β1·m + (1−β1)·g)   (torch.sign: 0 at 0 and at NaN)
        m = β2·m + (1−β2)·g              exp_avg
    """
    if grad_scale is not None:  # the scaled grad is read twice, and the scratch holds the interpolation
        scaled = ops.empty_like(param)
        ops.copy_(scaled, grad)
        ops.mul_(scaled, grad_scale)
        grad = scaled
    if decays(weight_decay):
        ops.mul_(param, 1 - lr * weight_decay)
    ops.copy_(scratch, exp_avg)
    ops.mul_(scratch, beta1)
    ops.add_(scratch, grad, alpha=1 - beta1)
    ops.sign_(scratch)
    ops.mul_(scratch, lr)
    ops.sub_(param, scratch)
    ops.mul_(exp_avg, beta2)
    ops.add_(exp_avg, grad, alpha=1 - beta2)


def lion_arguments(group: dict, inputs: StepInputs) -> tuple[dict, set[str]]:
    """``lion_update``'s arguments for a step of Lion."""
    beta1, beta2 = group["betas"]
    return dict(beta1=beta1, beta2=beta2, lr=inputs.lr, weight_decay=group["weight_decay"],
                grad_scale=inputs.grad_scale), set()


def lion_kernel_scalars(args: dict) -> dict:
    """``lion_update``'s arguments as the fused kernels take them."""
    return dict(beta1=args["beta1"], one_minus_beta1=1 - args["beta1"], beta2=args["beta2"],
                one_minus_beta2=1 - args["beta2"], lr=args["lr"], decay_mul=1 - args["lr"] * args["weight_decay"],
                grad_scale=1.0 if args["grad_scale"] is None else args["grad_scale"])


LION = Algorithm(SPEC, lion_update, lion_arguments, lion_kernel_scalars,
                 rule=("lion", ("lr", "betas", "weight_decay")))


class Lion(FastOptimizer):
    """Lion (see [lion_update][fastoptim.optimizers.lion.lion_update]): one momentum state, and an
    update of the same size ``lr`` for every element, so ``lr`` is usually 3–10 times smaller than
    AdamW's and ``weight_decay`` as many times larger.

    Args:
        params: parameters or param groups (dicts with per-group options).
        lr: learning rate, a float or a one-element tensor.
        betas: (β1, β2): β1 blends momentum and gradient into the sign, β2 is the momentum's decay.
        weight_decay: decoupled: ``p·(1 − lr·wd)`` before the update.
        (the arguments of every fastoptim optimizer)

    ``sn`` does not apply: Lion keeps no second moment. Clipping uses torch's eps, 1e-6. State per
    parameter: ``exp_avg``, as timm's Lion, whose state dicts load (its cautious variant is refused).
    """

    algorithm = LION

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, max_grad_norm: float = 0.0, stochastic_rounding: bool = False,
                 master_bits: int = 16, state_bits: int = 32, shard_group: ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, foreach=foreach,
                        fused=fused, max_grad_norm=max_grad_norm, stochastic_rounding=stochastic_rounding,
                        master_bits=master_bits, state_bits=state_bits)
        super().__init__(params, defaults, shard_group)
