"""AdamWSN and RMSPropSN: AdamW with a subset-norm second moment, as the AdamW-Subset-Norm paper's
reference code (``adamw_sn.py``, class ``AdamwSN``) defines it."""

from ..engines.ops import sqrt
from .adamw import AdamW
from .base import FastOptimizer, group_lr


class AdamWSN(AdamW):
    """AdamW with a subset-norm second moment, as the AdamW-Subset-Norm paper's
    reference ``AdamwSN`` (``adamw_sn.py``; see
    :func:`fastoptim.optimizers.adamw.adamw_update` with ``decay_after``).

    Param groups opt in with ``'sn': True``, as in that code's usage; the others get the same AdamW
    with one second-moment entry per element. ``subset_size`` picks the partition (see
    fastoptim.states.subset_norm): None, the default, sums 2-D params over their smaller dimension
    and leaves other shapes per element; k > 0 cuts each flattened param into consecutive subsets
    of the largest divisor of its size that is at most k; -k does that with k' = √numel / k.
    ``betas=(0, β2)`` is RMSPropSN: no first moment is kept (see :class:`RMSPropSN`).

    The paper's results need a learning rate about 10 times Adam's. ``sn`` (a constructor default
    for every group), ``maximize``, ``max_grad_norm`` and ``stochastic_rounding`` work as in
    :class:`fastoptim.Adan`; GradScaler and ``shard_group`` too. ``state_bits`` 16 or 8 keeps ``exp_avg`` in bf16 or
    8-bit blockwise codes; the subset-norm ``exp_avg_sq`` stays fp32.

    State per parameter: ``step`` (0-d fp32 tensor), ``exp_avg`` (unless β1 = 0), ``exp_avg_sq``
    in the partition's shape, and the partition: ``reduce_dim`` (the reference's key, for rows or
    columns) or ``subset_size``, so a resumed run keeps it. The reference's state dicts load.
    """

    n_betas = 2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, subset_size=None,
                 correct_bias=True, foreach=None, fused=None, *, sn=False, maximize=False, max_grad_norm=0.0,
                 stochastic_rounding=False, state_bits=32, shard_group=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, subset_size=subset_size,
                        correct_bias=correct_bias, foreach=foreach, fused=fused, sn=sn, maximize=maximize,
                        max_grad_norm=max_grad_norm, stochastic_rounding=stochastic_rounding, state_bits=state_bits)
        FastOptimizer.__init__(self, params, defaults, shard_group)

    def _check_group(self, group, max_grad_norm=None):
        FastOptimizer._check_group(self, group, max_grad_norm)  # AdamW's adds its torch options, not taken here
        if not isinstance(group["correct_bias"], bool):
            raise ValueError(f"Invalid correct_bias: {group['correct_bias']!r} (must be True or False)")

    @staticmethod
    def kernel_flags(group):
        """AdamW's kernel family: weight decay after the update, no bias correction inside the root."""
        return dict(amsgrad=False, first_moment=group["betas"][0] != 0)

    def _step_arguments(self, group, entry, grad_scale, increment):
        t = self._next_counts(entry, increment)
        beta1, beta2 = group["betas"]
        lr = group_lr(group)
        step_size = (lr * sqrt(1 - beta2**t) / (1 - beta1**t)) if group["correct_bias"] else lr + 0 * t
        args = dict(beta1=beta1, beta2=beta2, eps=group["eps"], lr=lr, weight_decay=group["weight_decay"],
                    grad_scale=grad_scale, step_size=step_size.to(entry.scalar_dtype), decay_after=True)
        return args, {"step_size"}



class RMSPropSN(AdamWSN):
    """RMSProp with a subset-norm second moment: :class:`AdamWSN` with β1 = 0, which keeps no first
    moment, so an ``sn`` matrix's whole state is O(√d)."""

    def __init__(self, params, lr=1e-3, beta2=0.999, eps=1e-6, weight_decay=0.0, subset_size=None,
                 correct_bias=True, foreach=None, fused=None, **options):
        super().__init__(params, lr, (0.0, beta2), eps, weight_decay, subset_size, correct_bias, foreach, fused,
                         **options)
