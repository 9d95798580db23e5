"""A step's scalars: the counts it reads, its algorithm's arguments, and, for a step that torch.compile
traces on the CPU, the two ops that compute them and advance the counts outside the graph.

Traced, the scalar math of a step (a dozen operations on 0-d tensors: bias corrections, weight decay
factors) would be a kernel of its own that inductor writes in C++ and compiles with the system
compiler, which costs more than the rest of a compiled step's first call. ``fastoptim::step_scalars``
computes those scalars as an eager step does, with the same code (and so the same numbers: Python
arithmetic where the eager step's count is a host number), and ``fastoptim::count_up`` advances the
counts; the graph of a fused step keeps these two ops and the kernel's, and compiles nothing."""
import json

import torch
from torch import Tensor

from .. import engines
from .algorithm import Algorithm, StepInputs


def count_after(count, increment, lr, traced=None):
    """This step's count, ``count + increment`` (``count``: a group's 0-d count, or a 1-d tensor of
    each param's), for the step's scalars (bias corrections), which need float64. A Python float
    where all of it lives on the host (a CPU ``count``, a number ``increment`` and ``lr``), no trace
    is running (``traced``: by default, whether torch.compile is tracing) and every param has the same
    count, as torch.optim reads a CPU step count: the scalars then cost Python arithmetic instead of a
    dozen tensor ops. Else a float64 tensor (on a GPU, or in a compiled step, nothing is read; params
    that started at other steps keep their own)."""
    traced = torch.compiler.is_compiling() if traced is None else traced
    if count.device.type == "cpu" and not isinstance(increment, Tensor) and not isinstance(lr, Tensor) and not traced:
        if count.dim() == 0:
            return count.item() + increment
        values = count.numpy()
        if (values == values[0]).all():
            return float(values[0]) + increment
    return count.to(torch.float64) + increment


def step_arguments(algorithm: Algorithm, group: dict, count: Tensor | None, increment: float | Tensor,
                   inputs: StepInputs, traced: bool) -> tuple[dict, set[str]]:
    """``algorithm``'s arguments for a step of ``group`` and the names of those that hold one value per
    param: ``inputs`` with the count the step reads, ``count + increment`` (``count``: the group's
    0-d count, the params' 1-d counts, or None; ``increment``: 1, or 0 on a step GradScaler skipped),
    for a step that torch.compile traces or not (``traced``)."""
    if count is not None:
        inputs = inputs._replace(count=count_after(count, increment, inputs.lr, traced))
    return algorithm.arguments(group, inputs)


# --- the ops of a traced CPU step -----------------------------------------------------------------

_ALGORITHMS = {}  # what step_scalars is named, to its algorithm: registered at tracing, in this process
_LIBRARY = torch.library.Library("fastoptim", "FRAGMENT")
_LIBRARY.define("step_scalars(str algorithm, str group, Tensor? lr, Tensor? grad_scale, Tensor? count, "
                "Tensor? increment, Tensor? first_reads, Tensor? factors, Tensor? found_inf, float? lr_number, "
                "float? grad_scale_number, ScalarType wide, bool stochastic, Device device, int n) -> Tensor[]")
_LIBRARY.define("count_up(Tensor(a!)[] counts, Tensor? increment) -> ()")
_LIBRARY.define("mark_read(Tensor(a!) first_reads, Tensor? increment) -> ()")  # no op may both mutate and return


def _name(algorithm):
    """What identifies ``algorithm``'s scalar math across processes (an inductor cache outlives one):
    its spec and the code of its two functions."""
    return ";".join([algorithm.spec.name] + [f"{f.__module__}:{f.__qualname__}:{f.__code__.co_firstlineno}"
                                              for f in (algorithm.arguments, algorithm.kernel_scalars)])


def prepare(algorithm: Algorithm, group: dict) -> tuple[str, str]:
    """What ``step_scalars`` takes of ``algorithm`` and ``group``, made before tracing (dynamo traces
    neither ``json`` nor a registry's change): the algorithm's name, registered, and the group's
    options that its arguments may read, as JSON text (numbers, bools, strings and their tuples; not
    the params, nor a tensor lr), which the graph keeps as constants while dynamo guards them."""
    name = _name(algorithm)
    _ALGORITHMS.setdefault(name, algorithm)
    options = {}
    for key, value in group.items():
        try:
            options[key] = json.loads(json.dumps(value))
        except TypeError:
            continue
    return name, json.dumps(options, sort_keys=True)


def _scalars(algorithm_name, group, lr, grad_scale, count, increment, first_reads, factors, found_inf,
             lr_number, grad_scale_number, wide, stochastic, device, n, fake=False):
    """The kernel's scalars in its spec's order, each a float64 tensor on ``device``: 0-d, or one value per
    param for those the arguments name so (``n`` params). ``fake``: their shapes alone."""
    algorithm = _ALGORITHMS[algorithm_name]
    lr = lr_number if lr is None else lr
    grad_scale = grad_scale_number if grad_scale is None else grad_scale
    inputs = StepInputs(lr, grad_scale, None, wide, first_reads, factors,
                        counts_per_param=count is not None and count.dim() == 1)
    if fake:  # placeholders for the numbers: only the names of the per-param scalars are needed
        _, per_param = algorithm.arguments(json.loads(group), inputs._replace(lr=1.0, grad_scale=None,
                                                                             count=None if count is None else 1.0))
        return [torch.empty((n,) if name in per_param else (), dtype=torch.float64, device=device)
                for name in algorithm.spec.all_scalars]
    args, per_param = step_arguments(algorithm, json.loads(group), count, 1 if increment is None else increment, inputs,
                                     traced=False)
    values = engines.fused.kernel_values(algorithm.spec, algorithm.kernel_scalars, args, found_inf, stochastic, device)
    out = []
    for name in algorithm.spec.all_scalars:
        value = values[name]
        value = value.to(device, torch.float64, copy=True) if isinstance(value, Tensor) else torch.tensor(
            float(value), dtype=torch.float64, device=device)
        out.append(value.repeat(n) if name in per_param and value.dim() == 0 else value)
    return out


def _count_up(counts, increment):
    torch._foreach_add_(counts, 1 if increment is None else increment)


def _mark_read(first_reads, increment):
    first_reads.clamp_(min=1 if increment is None else increment)


_LIBRARY.impl("step_scalars", _scalars, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::step_scalars", lambda *args: _scalars(*args, fake=True), lib=_LIBRARY)
_LIBRARY.impl("count_up", _count_up, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::count_up", lambda counts, increment: None, lib=_LIBRARY)
_LIBRARY.impl("mark_read", _mark_read, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::mark_read", lambda first_reads, increment: None, lib=_LIBRARY)


def traced_kernel_scalars(algorithm: Algorithm, prepared: tuple[str, str], count: Tensor | None,
                          increment: int | Tensor, inputs: StepInputs, found_inf: Tensor | None, stochastic: bool,
                          device: torch.device, n: int) -> tuple[dict, set[str]]:
    """A traced step's kernel scalars for ``n`` params (name to a float64 tensor, found_inf and the
    rounding seed included) and the names of those with one value per param, computed by
    ``fastoptim::step_scalars`` as :func:`step_arguments` and the fused engine compute them eagerly
    (``prepared``: :func:`prepare` of the algorithm and group). A compiled step reads
    ``inputs.first_reads`` on every call: a step that counts gave every param its optional states,
    which ``fastoptim::mark_read`` marks."""
    name, options = prepared

    def tensor(value):
        return value if isinstance(value, Tensor) else None

    def number(value):
        return None if value is None or isinstance(value, Tensor) else float(value)

    out = torch.ops.fastoptim.step_scalars(
        name, options, tensor(inputs.lr), tensor(inputs.grad_scale), count, tensor(increment), inputs.first_reads,
        inputs.factors, found_inf, number(inputs.lr), number(inputs.grad_scale), inputs.wide, stochastic, device, n)
    if inputs.first_reads is not None:
        torch.ops.fastoptim.mark_read(inputs.first_reads, tensor(increment))
    names = algorithm.spec.all_scalars
    return dict(zip(names, out)), {scalar for scalar, value in zip(names, out) if value.dim() == 1}


def traced_count_up(counts: list[Tensor], increment: int | Tensor) -> None:
    """Add ``increment`` (1, or a 0-d tensor: 0 on a step GradScaler skipped) to ``counts`` in a traced
    step whose scalars ``step_scalars`` computed, through ``fastoptim::count_up``. (Not where a
    kernel of the graph reads the counts: inductor may then run the op first.)"""
    torch.ops.fastoptim.count_up(counts, increment if isinstance(increment, Tensor) else None)
