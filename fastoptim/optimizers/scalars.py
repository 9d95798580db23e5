"""A step's scalars: the counts it reads, its algorithm's arguments, and, for a step that torch.compile
traces on the CPU, the ops that compute them and advance the counts outside the graph.

Traced, the scalar math of a step (a dozen operations on 0-d tensors: bias corrections, weight decay
factors) would be a kernel of its own that inductor writes in C++ and compiles with the system
compiler, which costs more than the rest of a compiled step's first call. ``fastoptim::step_scalars``
computes those scalars as an eager step does, and so the same numbers (each bucket's rounding seed
drawn where the eager step draws it): with a number lr, by the algorithm's native rule, which a bound
eager step runs (native.cpp's ``ruled_scalars``); else with the eager step's Python (a tensor lr, Muon's
per-param factors). ``fastoptim::step_factors`` computes the clip coefficient and GradScaler's factors,
``fastoptim::mark_read`` marks the states' first reads (``step_counts`` advances the counts); the
graph of a fused step keeps these ops and the kernels', and compiles nothing."""
import functools
import json
from typing import NamedTuple

import torch
from torch import Tensor

from .. import clip, engines
from ..engines import backends
from ..specs import COMMON_SCALARS
from ..step_cache import holds_any
from .algorithm import Algorithm, StepInputs
from .checks import is_number


def count_after(count, increment, lr, traced):
    """This step's count, ``count + increment`` (``count``: a group's 0-d count, or a 1-d tensor of
    each param's), for the step's scalars (bias corrections), which need float64: Python floats
    (one, or one per param) where all of it lives on the host (a CPU ``count`` and ``lr``) and no
    trace is running (``traced``: whether torch.compile is tracing), as torch.optim reads
    a CPU step count; each the count + 1, as a step that a GradScaler skips reads no scalars (a CPU
    ``found_inf``'s increment is not read). The scalars then cost Python arithmetic, the same that a
    bound step's native rule does (see Algorithm.rule). Else a float64 tensor (on a GPU, or in a
    compiled step, nothing is read)."""
    if count.device.type == "cpu" and not isinstance(lr, Tensor) and not traced:
        return [value + 1 for value in count.reshape(-1).numpy().tolist()]  # a CPU tensor's memory: no sync
    return count.to(torch.float64) + increment


def one_count(counts: list[Tensor]) -> Tensor | None:
    """The counts a step reads (see ``StepCounts.read``) as one tensor: none, the one given (a
    group's 0-d count, or the params' as one 1-d tensor), or the params' 0-d counts stacked."""
    if not counts:
        return None
    return counts[0] if len(counts) == 1 else torch.stack(counts)


def increment_of(found_inf: Tensor | None) -> int | Tensor:
    """What a step adds to the counts: 1, or with GradScaler's ``found_inf`` 0 on a step it skips."""
    return 1 if found_inf is None else (found_inf == 0).float()


def inverse_of(amp_scale: Tensor | None) -> Tensor | None:
    """GradScaler's 1/scale as fp32 (a reciprocal in float64 first, as torch's unscale does), or None."""
    return None if amp_scale is None else amp_scale.double().reciprocal().float()


def grad_scale(clip_factor: Tensor | None, inv_scale: Tensor | None, maximize: bool) -> float | Tensor | None:
    """What a group's gradient is multiplied by: the clip coefficient, GradScaler's 1/scale, and −1
    to ``maximize``; None for 1."""
    scale = clip_factor if inv_scale is None else inv_scale if clip_factor is None else clip_factor * inv_scale
    if maximize:
        return -1.0 if scale is None else -scale
    return scale


def step_arguments(algorithm: Algorithm, group: dict, count: Tensor | None, increment: float | Tensor,
                   inputs: StepInputs, traced: bool) -> tuple[dict, set[str]]:
    """``algorithm``'s arguments for a step of ``group`` and the names of those that hold one value per
    param: ``inputs`` with the count the step reads (see :func:`count_after`; ``count``: the group's
    0-d count, the params' 1-d counts, or None; ``increment``: 1, or 0 on a step GradScaler skipped),
    for a step that torch.compile traces or not (``traced``). Params at different counts on the host
    each get their arguments from their own count as a Python number, as torch.optim's AdamW computes
    them, those that depend on it one value per param (in ``inputs.wide``)."""
    if count is None:
        return algorithm.arguments(group, inputs)
    reached = count_after(count, increment, inputs.lr, traced)
    if isinstance(reached, Tensor):
        return algorithm.arguments(group, inputs._replace(count=reached))
    if len(set(reached)) == 1:
        return algorithm.arguments(group, inputs._replace(count=reached[0]))
    by_count = {t: algorithm.arguments(group, inputs._replace(count=t, counts_per_param=True))[0] for t in set(reached)}
    args, per_param = algorithm.arguments(group, inputs._replace(count=reached[0], counts_per_param=True))
    return args | {name: torch.tensor([by_count[t][name] for t in reached], dtype=inputs.wide, device=count.device)
                   for name in per_param}, per_param


# --- the ops of a traced CPU step -----------------------------------------------------------------

_ALGORITHMS = {}  # what step_scalars is named, to its algorithm: registered at tracing, in this process
_LIBRARY = torch.library.Library("fastoptim", "FRAGMENT")
_LIBRARY.define("step_scalars(str algorithm, str group, float[] numbers, Tensor? lr, Tensor? grad_scale, "
                "Tensor[] counts, Tensor? increment, Tensor? first_reads, int[] read_positions, Tensor? factors, "
                "Tensor? found_inf, "
                "float? lr_number, float? grad_scale_number, ScalarType wide, bool stochastic, Device device, "
                "int n, int[] owners) -> Tensor[]")
_LIBRARY.define("step_factors(Tensor? total, Tensor? amp_scale, Tensor? found_inf, float max_norm, float eps, "
                "ScalarType wide, bool[] maximize) -> Tensor[]")
_LIBRARY.define("mark_read(Tensor(a!) first_reads, Tensor? increment, int[] positions) -> ()")  # no op may both
# mutate and return


class TracedScalars(NamedTuple):
    """What ``step_scalars`` takes of an algorithm and a group, made before tracing (dynamo traces
    neither ``json`` nor a registry's change): the algorithm's registered ``name``; the group's
    options that its arguments may read, as JSON text (``options``: bools, strings, None; the numbers'
    keys); and ``numeric``, the keys of the options that hold numbers or tuples of them, which each
    traced step reads (:meth:`numbers`), so that dynamo guards them or, once one keeps changing (a
    weight-decay schedule), passes it as a symbolic input instead of a stale constant."""

    name: str
    options: str
    numeric: tuple

    def numbers(self, group: dict) -> list[float]:
        """The numbers of ``group``'s numeric options, in ``numeric``'s order."""
        numbers = []
        for key, length, _ in self.numeric:
            numbers.extend(map(float, group[key] if length is not None else (group[key],)))
        return numbers


def _name(algorithm):
    """What identifies ``algorithm``'s scalar math across processes (an inductor cache outlives one):
    its spec and where its two functions are defined."""
    return ";".join([algorithm.spec.name] + [
        f"{getattr(f, '__module__', '')}:{getattr(f, '__qualname__', type(f).__name__)}:"
        f"{getattr(getattr(f, '__code__', None), 'co_firstlineno', 0)}"
        for f in (algorithm.arguments, algorithm.kernel_scalars)])


def traced_scalars(algorithm: Algorithm, group: dict, keys) -> TracedScalars | None:
    """The :class:`TracedScalars` of ``algorithm`` and ``group`` (not the params, nor a tensor lr); None where
    another of the algorithm's options ``keys`` (the optimizer's ``defaults``, not a scheduler's keys: its
    ``initial_lr`` is a tensor beside a tensor lr) holds a tensor (betas of 0-d tensors), which the op's
    numbers cannot take: the traced step then computes the scalars as tensor ops, as an eager one does."""
    if any(holds_any(group.get(key), Tensor) for key in keys if key != "lr"):
        return None
    name = _name(algorithm)
    registered = _ALGORITHMS.setdefault(name, algorithm)
    # what the op computes of it: algorithms that differ elsewhere (Muon's AdamW companions: their flags) share it
    if (registered.spec, registered.arguments, registered.kernel_scalars) != (
            algorithm.spec, algorithm.arguments, algorithm.kernel_scalars):
        raise RuntimeError(f"fastoptim: two algorithms' scalar math is defined at {name}: give each "
                           "its own arguments and kernel_scalars functions")
    options, numeric = {}, []
    for key, value in group.items():
        if is_number(value) or isinstance(value, (tuple, list)) and value and all(map(is_number, value)):
            many = isinstance(value, (tuple, list))
            numeric.append((key, len(value) if many else None,
                            all(isinstance(v, int) for v in (value if many else (value,)))))
            continue
        try:
            options[key] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            continue
    return TracedScalars(name, json.dumps({"options": options, "numeric": numeric}, sort_keys=True), tuple(numeric))


@functools.lru_cache(maxsize=64)
def _decoded(options):
    """``prepare``'s JSON text of a group's options, decoded once (each compiled step's op reads it)."""
    return json.loads(options)


def _group(options, numbers):
    """The group options that ``traced_scalars`` and ``TracedScalars.numbers`` took apart, together again."""
    made = _decoded(options)
    group, numbers = dict(made["options"]), iter(numbers)
    for key, length, integral in made["numeric"]:
        values = [int(x) if integral else x for x in (next(numbers) for _ in range(1 if length is None else length))]
        group[key] = values[0] if length is None else tuple(values)
    return group


def _output(value, device):
    """A scalar of ``step_scalars`` as the op returns it: a float64 tensor on ``device`` of its own."""
    if isinstance(value, Tensor):
        return value.to(device, torch.float64, copy=True)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


@functools.lru_cache(maxsize=64)
def _rule_sources(options, keys):
    """Where each number that a native rule takes (of the option ``keys``, in order: see
    ``Algorithm.rule``) is among ``step_scalars``' arguments, for a group whose options ``prepare``
    made ``options``: an index into ``numbers``, None for the lr, or a bool option's 0.0 or 1.0; None
    where an option is none of these (the Python math then runs)."""
    made, offsets, at = _decoded(options), {}, 0
    for key, length, _ in made["numeric"]:
        offsets[key] = range(at, at + (1 if length is None else length))
        at = offsets[key].stop
    sources = []
    for key in keys:
        if key == "lr" or key in offsets:
            sources.extend([None] if key == "lr" else offsets[key])
        elif isinstance(made["options"].get(key), bool):
            sources.append(float(made["options"][key]))
        else:
            return None
    return tuple(sources)


@functools.lru_cache(maxsize=64)
def _per_param_indices(algorithm_name, options, numbers, counts_per_param, reads_first):
    """The positions in its spec's scalars of those ``algorithm_name``'s arguments hold one value per
    param (``reads_first``: with first reads given)."""
    algorithm = _ALGORITHMS[algorithm_name]
    first_reads = torch.ones(1) if reads_first else None
    _, per_param = algorithm.arguments(_group(options, numbers),
                                       StepInputs(1.0, None, 1.0, torch.float64, first_reads, None, counts_per_param))
    return [i for i, name in enumerate(algorithm.spec.all_scalars) if name in per_param]


def _ruled(algorithm, algorithm_name, options, numbers, lr, counts, first_reads, wide, n, owners):
    """The kernel's scalars past the common ones, computed natively by the algorithm's rule (see
    native.cpp's ``ruled_scalars``) where all of it is on the host as numbers: a CPU step with a number
    lr and no per-param factors; else None."""
    if algorithm.rule is None or not backends.cpu.AVAILABLE or wide not in (torch.float32, torch.float64):
        return None
    sources = _rule_sources(options, algorithm.rule[1])
    if sources is None:
        return None
    # as one_count makes them one tensor: 0-d counts stacked, or one 1-d tensor of them
    counts_per_param = len(counts) > 1 and counts[0].dim() == 0 or len(counts) == 1 and counts[0].dim() == 1
    per_param = _per_param_indices(algorithm_name, options, tuple(numbers), counts_per_param, first_reads is not None)
    rule_options = [lr if at is None else numbers[at] if type(at) is int else at for at in sources]
    return torch.ops.fastoptim.ruled_scalars(algorithm.rule[0], rule_options, counts, first_reads, per_param, owners,
                                             n, wide == torch.float32) or None


def _scalars(algorithm_name, options, numbers, lr, grad_scale, counts, increment, first_reads, read_positions,
             factors, found_inf, lr_number, grad_scale_number, wide, stochastic, device, n, owners, fake=False):
    """The kernel's scalars in its spec's order for the params ``owners`` of the group's ``n`` (all:
    none listed), each a float64 tensor on ``device``: 0-d, or one value per param for those the
    arguments name so; ``first_reads`` the params' marks (at ``read_positions``, where listed: see
    ``PlanStore.first_reads``). ``fake``: their shapes alone. On the host, with a number lr, its native
    rule computes them (``_ruled``); else the Python that the eager step runs."""
    algorithm = _ALGORITHMS[algorithm_name]
    if read_positions and first_reads is not None:
        first_reads = first_reads[read_positions]
    lr = lr_number if lr is None else lr
    grad_scale = grad_scale_number if grad_scale is None else grad_scale
    ruled = None
    if not fake and lr is not None and not isinstance(lr, Tensor) and factors is None and device.type == "cpu":
        ruled = _ruled(algorithm, algorithm_name, options, numbers, lr, counts, first_reads, wide, n, owners)
    if ruled is not None:
        common = dict(found_inf=0.0 if found_inf is None else found_inf,
                      seed=engines.fused.draw_seed(device) if stochastic else 0,
                      grad_scale=1.0 if grad_scale is None else grad_scale)
        return [_output(common[name], device) for name in COMMON_SCALARS] + ruled
    group, count = _group(options, numbers), one_count(counts)
    inputs = StepInputs(lr, grad_scale, None, wide, first_reads, factors,
                        counts_per_param=count is not None and count.dim() == 1)
    size = len(owners) if owners else n
    if fake:  # placeholders for the numbers: only the names of the per-param scalars are needed
        _, per_param = algorithm.arguments(group, inputs._replace(lr=1.0, grad_scale=None,
                                                                  count=None if count is None else 1.0))
        return [torch.empty((size,) if name in per_param else (), dtype=torch.float64, device=device)
                for name in algorithm.spec.all_scalars]
    # the whole group's arguments, then the bucket's of them, as the eager step computes them (a bucket's
    # counts alone could round apart: Python's and torch's pow differ in the last bit)
    args, per_param = step_arguments(algorithm, group, count, 1 if increment is None else increment, inputs,
                                     traced=False)
    values = engines.fused.with_common(algorithm.kernel_scalars(args), found_inf, stochastic, device)
    out = []
    for name in algorithm.spec.all_scalars:
        value = _output(values[name], device)
        if name in per_param:
            value = value.repeat(size) if value.dim() == 0 else value[owners] if owners else value
        out.append(value)
    return out


def _factors(total, amp_scale, found_inf, max_norm, eps, wide, maximize):
    """``step_factors``: the count's increment (with ``found_inf``), then each group's grad scale (see
    :func:`grad_scale`; with a clip's ``total``, the grads' sum of squares, or GradScaler's scale)."""
    inv_scale = inverse_of(amp_scale)
    factor = None if total is None else clip.coefficient_of(clip.norm_of(total, False, wide), max_norm, eps, inv_scale)
    # a copy each: groups that do not maximize share one scale, and an op's outputs may not alias
    scales = [] if factor is None and inv_scale is None else [grad_scale(factor, inv_scale, m).clone() for m in maximize]
    return ([] if found_inf is None else [increment_of(found_inf)]) + scales


def _mark_read(first_reads, increment, positions):
    least = 1 if increment is None else increment
    if positions:
        first_reads[positions] = first_reads[positions].clamp(min=least)
    else:
        first_reads.clamp_(min=least)


_LIBRARY.impl("step_scalars", _scalars, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::step_scalars", lambda *args: _scalars(*args, fake=True), lib=_LIBRARY)
_LIBRARY.impl("step_factors", _factors, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::step_factors", _factors, lib=_LIBRARY)  # tensor math: fake tensors run it
_LIBRARY.impl("mark_read", _mark_read, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::mark_read", lambda first_reads, increment, positions: None, lib=_LIBRARY)


def _tensor(value):
    return value if isinstance(value, Tensor) else None


def _number(value):
    return None if value is None or isinstance(value, Tensor) else float(value)


def traced_kernel_scalars(algorithm: Algorithm, traced: TracedScalars, group: dict, counts: list[Tensor],
                          increment: int | Tensor, inputs: StepInputs, found_inf: Tensor | None, stochastic: bool,
                          device: torch.device, n: int, owners: list[int], read_positions: list[int]) -> dict:
    """A traced step's kernel scalars (name to a float64 tensor, found_inf and the rounding seed
    included) for the params ``owners`` of a group of ``n`` (a bucket; all of them: none listed),
    computed by ``fastoptim::step_scalars`` as :func:`step_arguments` and the fused engine compute
    them eagerly, and the seed drawn there, as the eager step draws one per bucket. ``inputs.first_reads``
    holds the first-read marks of the group's params at ``read_positions``, where listed."""
    out = torch.ops.fastoptim.step_scalars(
        traced.name, traced.options, traced.numbers(group), _tensor(inputs.lr), _tensor(inputs.grad_scale),
        counts, _tensor(increment), inputs.first_reads, read_positions, inputs.factors, found_inf, _number(inputs.lr),
        _number(inputs.grad_scale), inputs.wide, stochastic, device, n, owners)
    return dict(zip(algorithm.spec.all_scalars, out))


def traced_factors(grads: list[Tensor] | None, max_norm: float, eps: float, amp_scale: Tensor | None,
                   found_inf: Tensor | None, maximize: list[bool]) -> tuple[int | Tensor, list]:
    """A traced step's count increment and each group's grad scale (``maximize``: the groups'), through
    ``fastoptim::step_factors``, which computes them as an eager step does: the clip coefficient of
    ``grads`` (None: no clip) from the clip kernel's sum of squares, GradScaler's 1/scale and skip."""
    total = None if grads is None else torch.ops.fastoptim.grad_norm_total(grads, False)
    out = torch.ops.fastoptim.step_factors(total, amp_scale, found_inf, max_norm, eps,
                                           clip.widest([] if grads is None else grads), maximize)
    increment, scales = (1, out) if found_inf is None else (out[0], out[1:])  # dynamo traces no list.pop
    return increment, scales if len(scales) else [grad_scale(None, None, m) for m in maximize]  # dynamo < 2.13: no bool(list)


def traced_mark_read(first_reads: Tensor, increment: int | Tensor, positions: list[int]) -> None:
    """Mark the params' optional states read (``first_reads``, at ``positions`` where listed, at least
    ``increment``), through ``fastoptim::mark_read``: a compiled step reads them on every call, and a
    step that counts gave every param its optional states."""
    torch.ops.fastoptim.mark_read(first_reads, _tensor(increment), positions)
