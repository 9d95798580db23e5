"""Muon (Jordan et al., 2024): momentum orthogonalized by Newton–Schulz iterations, with the same
signature and results as torch.optim.Muon, and AdamW companions for the params that are not matrices.
Its parts, and how a fused or sharded bucket runs them, are in ``muon_parts.py``."""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from .adamw import ADAMW
from .algorithm import Algorithm, StepInputs, no_flags
from .base import FastOptimizer
from .checks import check_number, one_value
from .muon_parts import (SPEC, bound_momentum, iterations, matrix_shape, muon_apply, muon_momentum,
                         row_blocks, run_muon_bucket)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's
# adjust_lr_fn: the factor of lr for a matrix of rows × cols, as torch.optim.Muon's (an empty one: no update)
ADJUST_LR = {
    "original": lambda rows, cols: math.sqrt(max(1, rows / cols)) if cols else 1.0,
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    "spectral_unclamped": lambda rows, cols: math.sqrt(rows / cols) if cols else 1.0,  # torch 2.15's
}


def muon_update(ops, *, param, grad, scratch, momentum_buffer, momentum, nesterov, lr, weight_decay, grad_scale,
                step_size, coefficients, eps, flatten, split_sizes, num_heads):
    """One Muon step, as torch.optim.Muon computes it: :func:`muon_momentum`, then O = NS(U) per
    matrix (see :func:`orthogonalize` and :func:`matrix_shape`, in bf16; per row block with
    ``split_sizes`` or ``num_heads``, see :func:`orthogonalize_blocks`), then :func:`muon_apply`."""
    direction = ops.empty_like(param)
    muon_momentum(ops, param=direction, grad=grad, scratch=scratch, momentum_buffer=momentum_buffer,
                  momentum=momentum, nesterov=nesterov, grad_scale=grad_scale)
    orthogonal = ops.per_matrix(iterations(dict(coefficients=coefficients, eps=eps, split_sizes=split_sizes,
                                                num_heads=num_heads)), direction, partial(matrix_shape, flatten=flatten))
    muon_apply(ops, param=param, grad=orthogonal, scratch=scratch, lr=lr, weight_decay=weight_decay,
               step_size=step_size)


def coefficients(group: dict) -> tuple[tuple[float, float, float], ...]:
    """The group's Newton–Schulz coefficients, one (a, b, c) per step; a ValueError if they are not."""
    given, steps = group["ns_coefficients"], group["ns_steps"]

    def triple(value):
        return (isinstance(value, Sequence) and len(value) == 3 and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) for x in value))

    if triple(given):
        return (tuple(map(float, given)),) * steps
    if isinstance(given, Sequence) and len(given) == steps and all(map(triple, given)):
        return tuple(tuple(map(float, value)) for value in given)
    raise ValueError(f"Invalid ns_coefficients: {given!r} (must be three finite numbers (a, b, c), or "
                     f"ns_steps={steps} such triples, one per step)")


def check_schedule(group: dict) -> None:
    """Raise a ValueError unless ``group``'s ``ns_steps`` is an int from 1 to 99, its ``ns_coefficients``
    give one (a, b, c) per step (see :func:`coefficients`) and its ``adjust_lr_fn`` is one Muon has."""
    steps = group["ns_steps"]
    if isinstance(steps, np.integer):  # a numpy int, as torch.optim takes one (steps read it as its value)
        steps = int(steps)
    if type(steps) is not int or not 1 <= steps < 100:
        raise ValueError(f"Invalid ns_steps: {steps!r} (must be an int from 1 to 99)")
    coefficients(group)
    if group["adjust_lr_fn"] is not None and (not isinstance(group["adjust_lr_fn"], str)
                                              or group["adjust_lr_fn"] not in ADJUST_LR):
        *others, last = map(repr, ADJUST_LR)
        raise ValueError(f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (must be None, {', '.join(others)} "
                         f"or {last})")


def check_flags(group: dict) -> None:
    """Raise a ValueError naming the first of Muon's own flags in ``group`` that is not a bool (``use_muon``
    picks the group's algorithm; a flag read by its truth would take ``"no"`` as True)."""
    for name in ("use_muon", "nesterov", "flatten"):
        if not isinstance(group[name], bool):
            raise ValueError(f"Invalid {name}: {group[name]!r} (must be True or False)")


def block_factors(group: dict, param: Tensor) -> list[float]:
    """``adjust_lr_fn``'s factor of lr for each row block of the matrices of ``param`` (one: whole
    matrices): a block steps as a matrix of its own, as dion's and torchtitan's per-head Muon take it."""
    rows, cols = matrix_shape(param.shape, group["flatten"])[-2:]
    adjust = ADJUST_LR[group["adjust_lr_fn"] or "original"]
    return [adjust(block, cols) for block in row_blocks(rows, group["split_sizes"], group["num_heads"]) or (rows,)]


def lr_factor(group: dict, param: Tensor) -> float:
    """``adjust_lr_fn``'s factor of lr for the matrices of ``param``: their blocks' (see
    :func:`block_factors`; blocks whose factors differ are refused when the param is checked)."""
    return block_factors(group, param)[0]


def muon_arguments(group: dict, inputs: StepInputs) -> tuple[dict, set[str]]:
    """``muon_update``'s arguments for a step of Muon: each matrix's step size is lr times its factor,
    rounded where torch.optim.Muon rounds it: a number lr times the factor in float64, a tensor lr
    times it as a tensor times a Python number (in at least float32, rounded once to the lr's dtype)."""
    lr, factors = inputs.lr, inputs.factors
    if isinstance(lr, Tensor):
        compute = torch.promote_types(lr.dtype, torch.float32)
        step_size = (lr.to(compute) * factors.to(compute)).to(lr.dtype)
    else:
        step_size = lr * factors
    args = dict(momentum=group["momentum"], nesterov=group["nesterov"], lr=lr,
                weight_decay=group["weight_decay"], grad_scale=inputs.grad_scale,
                step_size=step_size.to(inputs.wide), coefficients=coefficients(group),
                eps=group["eps"], flatten=group["flatten"], split_sizes=group["split_sizes"],
                num_heads=group["num_heads"])
    return args, {"step_size"}


MUON = Algorithm(SPEC, muon_update, muon_arguments, param_factors=lr_factor,
                 factor_options=("adjust_lr_fn", "flatten", "split_sizes", "num_heads"),
                 run=run_muon_bucket, bound_part=bound_momentum)
COMPANIONS = ADAMW._replace(fixed_flags=dict(amsgrad=False, first_moment=True), option_flags=no_flags)  # AdamW's


def eps_apart(group: dict) -> bool:
    """Whether a ``use_muon=False`` group's ``eps`` and ``adamw_eps``, its alias, hold two values (compared
    as Python numbers, a numpy one's value widened; an array of more than one value is refused by name)."""
    return one_value("eps", group["eps"]) != one_value("adamw_eps", group["adamw_eps"])


def with_companion_eps(group: dict, eps: float) -> dict:
    """``group`` with AdamW's ``eps``, and ``adamw_eps``, its alias in a ``use_muon=False`` group, kept equal."""
    return group | {"eps": eps, "adamw_eps": eps}


class Muon(FastOptimizer):
    """Muon with torch.optim.Muon's signature and results (see
    [muon_update][fastoptim.optimizers.muon.muon_update]), and AdamW for the params that are not
    hidden matrices, in the same optimizer: a param group with ``use_muon=False`` runs fastoptim's
    AdamW with the group's ``lr``, ``betas``, ``eps`` and ``weight_decay``, as Keller Jordan's
    MuonWithAuxAdam takes such groups (there is no Newton–Schulz floor in them).

    Args:
        params: parameters or param groups (dicts with per-group options). A Muon group takes
            matrices: 2-D params, 3-D params as batches of matrices over their last two dims (expert
            weights), and with ``flatten`` any param of 2+ dims as its first dim by the rest.
            Embeddings, the output head and 1-D params belong in a ``use_muon=False`` group.
        lr: learning rate, a float or a one-element tensor.
        weight_decay: decoupled: ``p·(1 − lr·wd)`` before the update.
        momentum: μ, the momentum buffer's decay, in [0, 1).
        nesterov: orthogonalize the Nesterov blend ``g + μ·(B − g)`` instead of the buffer.
        ns_coefficients: the Newton–Schulz step's (a, b, c), for every step; or a sequence of
            ``ns_steps`` such triples, one per step (schedules such as Polar Express's).
        eps: the floor of the norm each matrix is divided by before the iterations.
        ns_steps: the number of Newton–Schulz steps, 1 to 99.
        adjust_lr_fn: the lr's factor for a matrix of rows × cols: ``"original"`` (None):
            √max(1, rows/cols); ``"match_rms_adamw"``: 0.2·√max(rows, cols), so that AdamW's lr
            and weight decay carry over; ``"spectral_unclamped"`` (torch 2.15's): √(rows/cols),
            the original without its clamp, so a wide matrix steps by less than lr.
        flatten: orthogonalize a param of 3+ dims as its first dim by the rest (convolution
            weights) instead of as a batch of matrices.
        split_sizes: orthogonalize each matrix as row blocks of these sizes (a fused QKV
            projection), which sum to its rows, each block as a matrix of its own, the lr scaled by
            ``adjust_lr_fn`` of the block's shape (as dion's and torchtitan's per-head Muon); blocks
            whose factors differ are refused. None: whole matrices.
        num_heads: the same with this many equal row blocks (attention heads), which divide the rows.
        use_muon: False for a group of AdamW companions (usually set per group).
        betas: the AdamW companions' (β1, β2).
        adamw_eps: the eps of the AdamW companion groups that set none (``eps`` here is the
            Newton–Schulz floor; in a ``use_muon=False`` group, ``eps`` is AdamW's, and
            ``adamw_eps`` its alias: a group giving both, apart, is refused).
        (the arguments of every fastoptim optimizer)

    The loop engine (``foreach=False, fused=False``) orthogonalizes one matrix at a time; every
    other engine stacks the matrices of one shape into a batch. The fused engines run the momentum
    (``muon_momentum``, the elementwise half, with 8-bit states inside the kernel) in the C or Triton
    kernel, and the AdamW companions on theirs; a step that torch.compile traces runs the Muon
    groups as foreach. ``sn`` and ``state_bits`` apply to the
    companions' states; ``state_bits`` to the momentum buffer too. State per parameter: Muon's
    ``momentum_buffer``, as torch.optim.Muon's, whose state dicts load; the companions' are
    AdamW's. Under ZeRO (``shard_group``) each rank steps whole params. Under FSDP2, each matrix goes
    whole to one owner rank (the matrices spread over the ranks by size, decided once from their
    global shapes), which orthogonalizes its matrices of one shape as one batch, and its rows come
    back: one all-to-all each way per shape group and step, with no host sync; the results are one
    process's (see :func:`orthogonalize_shards`).
    """

    algorithm = MUON
    clip_eps = None  # a Muon group's eps is the Newton-Schulz floor, a companion's AdamW's: the last group's was
    # the one or the other by the groups' order (helper-98); torch.optim.Muon is clipped by clip_grad_norm_

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: Sequence[float] | Sequence[Sequence[float]] = DEFAULT_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *, flatten: bool = False,
                 split_sizes: Sequence[int] | None = None, num_heads: int | None = None,
                 use_muon: bool = True, betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None,
                 max_grad_norm: float = 0.0, stochastic_rounding: bool = False, master_bits: int = 16,
                 sn: bool = False, subset_size: int | None = None, state_bits: int = 32,
                 shard_group: ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        flatten=flatten, split_sizes=split_sizes, num_heads=num_heads, use_muon=use_muon, betas=betas, adamw_eps=adamw_eps, maximize=maximize,
                        foreach=foreach, fused=fused, max_grad_norm=max_grad_norm,
                        stochastic_rounding=stochastic_rounding, master_bits=master_bits, sn=sn,
                        subset_size=subset_size, state_bits=state_bits)
        super().__init__(params, defaults, shard_group)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group; in a ``use_muon=False`` one, ``eps`` (or ``adamw_eps``, its alias) is
        AdamW's, the constructor's ``adamw_eps`` where it gives neither."""
        if param_group.get("use_muon", self.defaults["use_muon"]) is False:
            given = {name: param_group[name] for name in ("eps", "adamw_eps") if name in param_group}
            if len(given) == 2 and eps_apart(given):
                raise ValueError(f"Invalid eps: {given['eps']!r} and adamw_eps {given['adamw_eps']!r} in a "
                                 "use_muon=False group, where adamw_eps is an alias of eps (AdamW's): give one")
            param_group = with_companion_eps(param_group, next(iter(given.values()), self.defaults["adamw_eps"]))
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict (see :class:`FastOptimizer`), its ``use_muon=False`` groups' eps taken from
        their ``adamw_eps`` where saved: saved before eps was AdamW's in such a group, ``eps`` holds the
        Newton–Schulz floor there (later saves keep the two equal). A group that saved neither (another
        optimizer's) gets this optimizer's ``adamw_eps``."""
        groups = [with_companion_eps(group, group.get("adamw_eps", group.get("eps", self.defaults["adamw_eps"])))
                  if group.get("use_muon", self.defaults["use_muon"]) is False else group
                  for group in state_dict["param_groups"]]
        super().load_state_dict(state_dict | {"param_groups": groups})

    def _check_between_steps(self, group, params):
        super()._check_between_steps(group, params)
        # set since it was added, each checked as the constructor checks it, before any group steps
        check_flags(group)
        if group["use_muon"]:
            check_schedule(group)
        check_row_blocks(group)  # a change makes the factors and checks the params again
        if not group["use_muon"] and eps_apart(group):  # one of them set since it was added
            raise ValueError(f"Invalid eps: {group['eps']!r} and adamw_eps {group['adamw_eps']!r} in a use_muon=False "
                             "group, where adamw_eps is an alias of eps (AdamW's): set both")

    def _algorithm(self, group):
        use_muon = group["use_muon"]
        if type(use_muon) is not bool:
            check_flags(group)  # which names it, before its truth is read
        return MUON if use_muon else COMPANIONS

    def _algorithms(self):
        return MUON, COMPANIONS

    def _use_new_states(self, group, entry, traced):
        # a sharded bucket's exchange is planned from its params' global shapes, which its plan's local
        # shards do not tell: its bucket plan (kept between steps, made anew with the buckets) holds them
        super()._use_new_states(group, entry, traced)
        for plan in entry.buckets:
            if plan.reduce is not None:
                plan.sharded_params = [entry.params[i] for i in plan.indices]

    def _check_group(self, group, max_grad_norm=None):
        super()._check_group(group, max_grad_norm)
        check_flags(group)
        check_number("adamw_eps", group["adamw_eps"], tensor=True)
        check_number("momentum", group["momentum"], tensor=True)
        check_schedule(group)
        check_row_blocks(group)
        if group["use_muon"]:
            for param in group.get("params", ()):
                self._check_matrix(param, group)

    def _check_state(self, param, state, group):
        # a param reshaped (.data =) or appended to the group since it was checked, or flatten turned off
        if group["use_muon"]:
            self._check_matrix(param, group)
        super()._check_state(param, state, group)

    @staticmethod
    def _check_matrix(param, group):
        """Refuse a param that a Muon group cannot orthogonalize, saying where it belongs, or cannot
        cut into its row blocks."""
        flatten = group["flatten"]
        if param.dim() < 2 or param.dim() > 3 and not flatten:
            raise ValueError(
                f"Muon orthogonalizes matrices, and a param of shape {tuple(param.shape)} is not one: put 1-D params "
                "(and embeddings and the output head) in a param group with use_muon=False, which runs AdamW"
                + ("" if param.dim() < 2 else ", or set flatten=True to take it as its first dim by the rest"))
        if param.is_complex():
            raise ValueError("Muon does not support complex params: put them in a use_muon=False group (AdamW)")
        rows = matrix_shape(param.shape, flatten)[-2]
        if group["split_sizes"] is not None and sum(group["split_sizes"]) != rows:
            raise ValueError(f"Invalid split_sizes: {group['split_sizes']!r} sum to {sum(group['split_sizes'])}, and a "
                             f"param of shape {tuple(param.shape)} has matrices of {rows} rows: they must sum to its rows")
        if group["num_heads"] is not None and rows % group["num_heads"]:
            raise ValueError(f"Invalid num_heads: {group['num_heads']!r} does not divide the {rows} rows of the "
                             f"matrices of a param of shape {tuple(param.shape)}")
        if len(set(block_factors(group, param))) > 1:
            raise ValueError(f"Invalid split_sizes: {group['split_sizes']!r} cut the matrices of a param of shape "
                             f"{tuple(param.shape)} into blocks whose adjust_lr_fn={group['adjust_lr_fn']!r} factors "
                             "differ, and a param steps by one factor: put the blocks in params of their own, or use "
                             "an adjust_lr_fn that gives them one factor")


def check_row_blocks(group: dict) -> None:
    """Raise unless the group's ``split_sizes`` (positive ints, kept as a tuple) and ``num_heads`` (a
    positive int) are valid, and at most one is set, in a Muon group."""
    sizes, heads = group["split_sizes"], group["num_heads"]
    if sizes is not None:
        if (not isinstance(sizes, Sequence) or isinstance(sizes, str) or not sizes
                or not all(type(size) is int and size > 0 for size in sizes)):
            raise ValueError(f"Invalid split_sizes: {sizes!r} (must be None or a non-empty sequence of positive ints, "
                             "the row blocks' sizes)")
        group["split_sizes"] = tuple(sizes)
    if heads is not None and (type(heads) is not int or heads < 1):
        raise ValueError(f"Invalid num_heads: {heads!r} (must be None or a positive int)")
    if sizes is not None and heads is not None:
        raise ValueError("split_sizes and num_heads both cut a matrix into row blocks: give one")
    if not group["use_muon"] and (sizes is not None or heads is not None):
        raise ValueError("split_sizes and num_heads cut Muon's matrices, and a use_muon=False group (AdamW) has none")
