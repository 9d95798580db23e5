"""AdamWSN and RMSPropSN: AdamW with a subset-norm second moment, as the AdamW-Subset-Norm paper's
reference code (``adamw_sn.py``, class ``AdamwSN``) defines it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..engines.ops import sqrt
from .adamw import ADAMW, AdamW
from .algorithm import StepInputs
from .base import FastOptimizer, in_dtype

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def adamwsn_arguments(group: dict, inputs: StepInputs) -> tuple[dict, set[str]]:
    """``adamw_update``'s arguments for a step of AdamWSN: the reference's bias corrections, both in
    the step size (or none without ``correct_bias``), and weight decay after the update."""
    beta1, beta2 = group["betas"]
    t, lr = inputs.count, inputs.lr
    step_size = (lr * sqrt(1 - beta2**t) / (1 - beta1**t)) if group["correct_bias"] else lr + 0 * t
    args = dict(beta1=beta1, beta2=beta2, eps=group["eps"], lr=lr, weight_decay=group["weight_decay"],
                grad_scale=inputs.grad_scale, step_size=in_dtype(step_size, inputs.wide), decay_after=True)
    return args, inputs.per_param({"step_size"})


# AdamW's kernel family, with no bias correction inside the root and no first moment where β1 = 0
ADAMWSN = ADAMW._replace(arguments=adamwsn_arguments,
                         fixed_flags=dict(amsgrad=False),
                         option_flags=lambda group: dict(first_moment=group["betas"][0] != 0),
                         rule=("adamwsn", ("lr", "betas", "eps", "weight_decay", "correct_bias")))


class AdamWSN(AdamW):
    """AdamW with a subset-norm second moment, as the AdamW-Subset-Norm paper's
    reference ``AdamwSN`` (``adamw_sn.py``; see
    [adamw_update][fastoptim.optimizers.adamw.adamw_update] with ``decay_after``).

    Args:
        params: parameters or param groups; groups opt in with ``'sn': True``, as in that code's
            usage, and the others get the same AdamW with one second-moment entry per element.
        lr: learning rate, a float or a one-element tensor; the paper's results need about 10
            times Adam's.
        betas: (β1, β2); ``β1 = 0`` keeps no first moment (see [RMSPropSN][fastoptim.RMSPropSN]).
        eps: added to the denominator after the square root.
        weight_decay: decoupled, ``p·(1 − lr·wd)`` after the update, as the reference.
        subset_size: the partition (see fastoptim.states.subset_norm): None sums 2-D params over
            their smaller dimension and leaves other shapes per element; k > 0 cuts each flattened
            param into consecutive subsets of the largest divisor of its size that is at most k;
            -k does that with k' = √numel / k.
        correct_bias: bias correction in the step size, as the reference's default.
        sn: the default of ``'sn'`` for groups that do not set it.
        (the arguments of every fastoptim optimizer)

    Under ``state_bits`` 16 or 8, the subset-norm ``exp_avg_sq`` stays fp32.

    State per parameter: ``step`` (0-d fp32 tensor), ``exp_avg`` (unless β1 = 0), ``exp_avg_sq``
    in the partition's shape, and the partition: ``reduce_dim`` (the reference's key, for rows or
    columns) or ``subset_size``, so a resumed run keeps it. The reference's state dicts load.
    """

    algorithm = ADAMWSN

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, subset_size: int | None = None,
                 correct_bias: bool = True, foreach: bool | None = None, fused: bool | None = None, *,
                 sn: bool = False, maximize: bool = False, max_grad_norm: float = 0.0,
                 stochastic_rounding: bool = False, master_bits: int = 16, state_bits: int = 32,
                 shard_group: ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, subset_size=subset_size,
                        correct_bias=correct_bias, foreach=foreach, fused=fused, sn=sn, maximize=maximize,
                        max_grad_norm=max_grad_norm, stochastic_rounding=stochastic_rounding, master_bits=master_bits,
                        state_bits=state_bits)
        FastOptimizer.__init__(self, params, defaults, shard_group)

    _check_plan = FastOptimizer._check_plan  # AdamW's adds its torch options, not taken here

    def _check_group(self, group, max_grad_norm=None):
        super()._check_group(group, max_grad_norm)
        if not isinstance(group["correct_bias"], bool):
            raise ValueError(f"Invalid correct_bias: {group['correct_bias']!r} (must be True or False)")


class RMSPropSN(AdamWSN):
    """RMSProp with a subset-norm second moment: [AdamWSN][fastoptim.AdamWSN] with β1 = 0, which keeps no first
    moment, so an ``sn`` matrix's whole state is O(√d).

    Args:
        params: parameters or param groups, as [AdamWSN][fastoptim.AdamWSN] takes them.
        lr: learning rate, a float or a one-element tensor.
        beta2: the decay rate of the second moment.
        eps: added to the denominator after the square root.
        weight_decay: decoupled, after the update.
        subset_size: the partition under ``sn``, as [AdamWSN][fastoptim.AdamWSN] takes it.
        correct_bias: bias correction in the step size.
        foreach: the engine, as [AdamWSN][fastoptim.AdamWSN] takes it.
        fused: the engine, as [AdamWSN][fastoptim.AdamWSN] takes it.
        **options: [AdamWSN][fastoptim.AdamWSN]'s keyword-only arguments (``sn``, ``maximize``,
            ``max_grad_norm``, ``stochastic_rounding``, ``master_bits``, ``state_bits``, ``shard_group``).
    """

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, beta2: float = 0.999, eps: float = 1e-6,
                 weight_decay: float = 0.0, subset_size: int | None = None, correct_bias: bool = True,
                 foreach: bool | None = None, fused: bool | None = None, **options: Any) -> None:
        super().__init__(params, lr, (0.0, beta2), eps, weight_decay, subset_size, correct_bias, foreach, fused,
                         **options)
