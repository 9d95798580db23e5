"""The checks of a fastoptim optimizer's inputs: hyperparameters, a tensor lr or betas, and params.
Each raises a ValueError that names the first invalid input, before anything changes."""
import functools
import inspect
import math
import numbers
import operator
import sys
import types
from itertools import repeat
from operator import attrgetter

import numpy as np
import torch
from torch import Tensor

from .. import distributed
from ..states import master, subset_norm
from ..step_cache import DEVICE, DTYPE, SHAPE


def normalize_betas(group):
    """Take tensor betas as torch.optim does: each holds one floating-point number, which every step reads
    (so a write in place is followed, as one written between steps is); one of several dimensions (shape
    (1,)) as its 0-d view, which shares its memory."""
    betas = group["betas"]
    if isinstance(betas, (tuple, list)) and any(isinstance(beta, Tensor) for beta in betas):
        for i, beta in enumerate(betas):
            if isinstance(beta, Tensor) and (beta.numel() != 1 or not beta.is_floating_point()):
                raise ValueError(f"Invalid betas[{i}]: a Tensor beta must hold one floating-point number, got "
                                 f"{beta.dtype} of shape {tuple(beta.shape)}")
        if any(isinstance(beta, Tensor) and beta.dim() for beta in betas):
            set_option(group, "betas", [beta.view(()) if isinstance(beta, Tensor) else beta for beta in betas])


NUMPY_VALUES = (np.generic, np.ndarray)  # numpy's numbers, bools and arrays


def plain(value):
    """A numpy value's Python value (a float for a long double, whose ``tolist`` keeps it one); any other
    value as it is."""
    if not isinstance(value, NUMPY_VALUES):
        return value
    value = value.tolist()
    return float(value) if isinstance(value, np.floating) else value


def one_value(name, value):
    """The value of option ``name``, which holds one: :func:`plain`'s, and of an array of one element (any
    shape) its element, as of a one-element tensor lr; a ValueError naming ``name`` for an array or a
    tensor of more (whose truth is no value)."""
    if isinstance(value, Tensor) and value.numel() != 1:
        raise ValueError(f"Invalid {name}: a tensor of shape {tuple(value.shape)} (give a number, or a tensor of "
                         "one element)")
    if isinstance(value, np.ndarray) and value.ndim:
        if value.size != 1:
            raise ValueError(f"Invalid {name}: {value!r} (an array of shape {value.shape}: give a number, or an "
                             "array of one element)")
        value = value.reshape(())
    return plain(value)


def flag_value(name, value):
    """The value of flag ``name`` as the plan reads it, which ``check_plan_options`` has checked: None, or
    :func:`one_value`'s as a bool (0 and 1 are False and True, as torch.optim takes them)."""
    value = one_value(name, value)
    return None if value is None else bool(value)


def check_hyperparameters(group, n_betas):
    """Raise a ValueError that names the first invalid hyperparameter of ``group``."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        check_tensor_lr(lr)
        lr = lr.item()  # construction time only, never in step()
    for name, value in (("lr", lr), *((name, group[name]) for name in ("eps", "weight_decay", "max_grad_norm")
                                      if name in group)):  # an algorithm may take no eps (Lion)
        check_number(name, value, tensor=name in ("eps", "weight_decay"))  # the clip's threshold is a number
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != n_betas:
        raise ValueError(f"Invalid betas: {betas!r} (expected {n_betas} numbers)")
    for i, beta in enumerate(betas):
        check_number(f"betas[{i}]", beta, below=1.0, tensor=True)


def check_plan_options(group):
    """Raise a ValueError naming the first of ``group``'s options that decide its step's plan (the engine,
    the states' formats, subset norms, rounding) that holds what the optimizer does not take: when the
    group is added, and whenever its plan is made again for an option written between steps, which may
    hold a numpy value (read as its Python value)."""
    for flag in ("foreach", "fused"):
        if one_value(flag, group[flag]) not in (None, True, False):
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be None, True or False)")
    for flag in ("maximize", "stochastic_rounding", "sn", "amsgrad"):
        if one_value(flag, group.get(flag, False)) not in (True, False):  # 0 and 1 too, as torch.optim takes them
            raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be True or False)")
    subset_norm.check_subset_size(one_value("subset_size", group.get("subset_size")))
    master_bits, state_bits = one_value("master_bits", group["master_bits"]), one_value("state_bits", group["state_bits"])
    if type(master_bits) is not int or master_bits not in master.BITS:
        raise ValueError(f"Invalid master_bits: {group['master_bits']!r} (must be 16, 24 or 32)")
    if master_bits > 16 and one_value("stochastic_rounding", group["stochastic_rounding"]):
        raise ValueError(f"Invalid master_bits: {master_bits} with stochastic_rounding, which rounds the "
                         "params of master_bits=16; a remainder keeps what rounding drops")
    if type(state_bits) is not int or state_bits not in (8, 16, 32):
        raise ValueError(f"Invalid state_bits: {group['state_bits']!r} (must be 32, 16 for bf16 states or 8 for "
                         "8-bit blockwise states)")


# The options whose numbers must stay below a bound, by name (every other number option: any finite number >= 0)
BELOW = {"momentum": 1.0}


def check_number(name, value, below=None, tensor=False):
    """Raise a ValueError naming ``name`` unless ``value`` is a number (not a bool) in [0, ``below``) (None:
    ``name``'s in ``BELOW``, else infinity): a numpy number, or an array of one element, as its value
    (:func:`one_value`), as torch.optim takes them; with ``tensor``, a 0-d floating-point tensor too, which a
    step reads as it reads a beta's (its value checked where it is on the CPU: another device's is read by
    the step there, not looked at)."""
    if tensor and isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point():
        if value.device.type != "cpu":
            return
        value = value.item()  # when a group is added or loaded, never in step()
    value = one_value(name, value)
    below = BELOW.get(name, math.inf) if below is None else below
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < below:
        requirement = "a finite number >= 0" if below == math.inf else f"in [0, {below:g})"
        raise ValueError(f"Invalid {name}: {value!r} (must be {requirement})")


def check_tensor_lr(lr, device=None):
    """A Tensor lr must hold one floating-point number (any shape, as torch.optim accepts) on the
    params' device, where the kernels read it."""
    if lr.numel() != 1 or not lr.is_floating_point():
        raise ValueError(f"Invalid lr: a Tensor lr must be a one-element floating-point tensor, got {lr.dtype} "
                         f"of shape {tuple(lr.shape)}")
    if device is not None and lr.device != device:
        raise ValueError(f"Invalid lr: a Tensor lr must be on the params' device, {device}, not {lr.device}")


def is_step_count(value, device):
    """Whether ``value`` is a step count as a step reads and advances it: a 0-d fp32 tensor on ``device``."""
    return isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.float32 and value.device == device


def step_count(value, device, name="step"):
    """``value`` as a step count (see :func:`is_step_count`), a copy on ``device``: a real number (official
    Adan and timm keep an int; torch.optim takes one, where it loads one; a numpy one) or a 0-d tensor of
    one. A ValueError naming ``name`` unless it is a whole number >= 0 (a negative count divides by zero
    in a bias correction). Reads a tensor's value: not for a step's every call."""
    if isinstance(value, Tensor) and not (value.dim() or value.dtype == torch.bool or value.is_complex()):
        count = value.to(torch.float32)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            count = torch.tensor(float(value), dtype=torch.float32)
        except OverflowError:
            count = torch.tensor(math.inf)
    else:
        raise ValueError(f"Invalid {name}: {value!r} (must be a number or a 0-d tensor)")
    check_whole_count(count.item(), name)
    return count.to(device=device, copy=True)


def whole_counts(values: list[float]) -> bool:
    """Whether each of ``values`` (step counts read as Python floats) is a whole number >= 0: not 2.5, -1
    (a bias correction would divide by zero), NaN or inf (no float of those is an integer)."""
    return all(map(float.is_integer, values)) and min(values, default=0.0) >= 0


def check_whole_count(value: float, name: str = "step") -> None:
    """Refuse a step count's ``value`` that is no whole number >= 0, naming ``name``."""
    if not whole_counts([value]):
        raise ValueError(f"Invalid {name}: {value!r} (must be a whole number >= 0)")


def overlaps_itself(tensor):
    """Whether two elements of ``tensor`` may share memory (an expanded, stride-0 view, say): its
    dimensions, ordered by stride, must each step past everything the smaller ones reach."""
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_in_one_group(group, groups, name):
    """Refuse a param of ``group`` that another of ``groups`` lists too, or ``group`` listed twice in them,
    written since it was added (``add_param_group`` refuses it): torch.optim would step such a param once
    per group and advance its count as often, where the plans hold one state and one count per param."""
    ids, listed = set(map(id, group["params"])), 0
    for other in groups:
        listed += other is group
        if listed > 1 or other is not group and not ids.isdisjoint(map(id, other["params"])):
            raise ValueError(f"{name}: a parameter appears in more than one param group (written into a group's "
                             "params, or a group into the param groups, since it was added); list each parameter "
                             "in one group")


# The dtypes of params a step takes (states.formats has a format for each): others (float8, complex32) failed
# midway through a step, an earlier param already stepped (helper-100)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.complex128)


def check_params(params, name):
    """Refuse a param listed twice or one that overlaps itself (an update would be applied twice to the same
    memory, from two threads in the fused engines), and one that requires or has a grad, of a dtype no step
    takes (``PARAM_DTYPES``): a frozen one (a quantized model's int8 weights) is never stepped, as in torch.optim."""
    if len(set(map(id, params))) != len(params):
        raise ValueError(f"{name}: a parameter appears twice in its param group; list each parameter once")
    for param in params:
        if param.dtype not in PARAM_DTYPES and (param.requires_grad or param.grad is not None):
            raise ValueError(f"{name}: a parameter of shape {tuple(param.shape)} is {param.dtype}; the optimizers "
                             f"step {', '.join(str(dtype).removeprefix('torch.') for dtype in PARAM_DTYPES)} params")
        if overlaps_itself(distributed.local(param)):
            raise ValueError(f"{name}: a parameter of shape {tuple(param.shape)} with strides {param.stride()} "
                             "overlaps itself (an expanded view?), so its elements cannot be updated one by "
                             "one; optimize a tensor that owns its memory (.clone())")


def is_number(value) -> bool:
    """Whether ``value`` is an int or a float, and no bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_NUMBERS = (float, int, bool)  # as the constructor's checks and a step read them
NUMBER_TERMS = "an int or a float, a real numpy number, or a floating-point tensor of one value"  # an lr's
OPTION_TERMS = "an int or a float, a real numpy number, or a 0-d floating-point tensor"  # any other option's


@functools.cache
def number_options(cls, defaults=is_number) -> tuple:
    """The options that fastoptim's optimizer classes among ``cls`` and those it derives from give a number
    by default in their signatures (a float, or an int that is no bool; with ``defaults``, what it takes):
    those its steps read as numbers, whatever a user gave the constructor. A subclass that passes
    ``**kwargs`` on keeps its base's; a subclass's own options are its own to read."""
    return tuple(dict.fromkeys(
        name for klass in cls.__mro__ if klass.__module__.startswith("fastoptim.")
        and isinstance(vars(klass).get("__init__"), types.FunctionType)
        for name, parameter in inspect.signature(klass.__init__).parameters.items()
        if defaults(parameter.default)))


def check_bool_options(group: dict, cls) -> None:
    """Raise a ValueError naming the first option of ``group`` whose default in ``cls``'s signature is a bool
    (``amsgrad``, ``no_prox``, ``correct_bias``) given what a step would read only the truth of: text (a
    config file's ``"False"`` is true), a sequence, a mapping, or a tensor of several values."""
    for name in number_options(cls, _is_bool):
        value = group.get(name)
        if isinstance(value, (str, bytes, tuple, list, dict, set)):
            raise ValueError(f"Invalid {name}: {value!r} (must be True or False)")
        if isinstance(value, Tensor):
            one_value(name, value)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


@functools.cache
def number_bounds(cls) -> tuple:
    """(option, the bound its number stays below: BELOW's, else infinity) for each of
    :func:`number_options`, which :func:`check_numbers` takes."""
    return tuple((name, BELOW.get(name, math.inf)) for name in number_options(cls))


def a_real_number(name: str, value) -> bool:
    """Whether a step reads option ``name``'s ``value`` as one real number: an int, a float or a bool (as
    Python reads it), a real numpy number or array (:func:`plain_values` reads one of one element and
    refuses more), or a tensor: an lr of one floating-point value (:func:`check_tensor_lr`), any other
    option a 0-d floating-point one, as a beta."""
    if isinstance(value, Tensor):
        return value.is_floating_point() and (value.numel() == 1 if name == "lr" else value.dim() == 0)
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype.kind in "biuf"
    return isinstance(value, _NUMBERS)


def check_numbers(group: dict, names: tuple) -> None:
    """Raise a ValueError naming the first of options ``names`` that ``group`` holds as what no step reads
    as a number (None, text, a complex number, a list, a tensor of several values: written since it was
    added; see :func:`a_real_number`), or as a number that is not finite (a NaN lr from a schedule made the
    params NaN) or not below its bound (:data:`BELOW`: Muon's momentum from 1), before any group steps.
    Not the constructor's lower bound: a schedule's float arithmetic may take a decay to 0 a hair below it
    (torch's ``LinearLR(end_factor=0)`` ends at -4e-22), which torch.optim steps with. A tensor's value is
    looked at where it is on the CPU, as a tensor beta's. An option the group does not hold (a subclass's own
    argument, kept under another key) is left alone.

    Args:
        group: the param group, read.
        names: (option, bound) for each option to check (see :func:`number_bounds`).
    """
    for name, below in names:
        value = group.get(name, 0.0)
        kind = type(value)
        if kind is float:
            if value - value == 0.0 and value < below:  # not NaN, nor an infinity (inf - inf is NaN)
                continue
        elif kind is int:
            if value < below and -_FLOAT_MAX <= value <= _FLOAT_MAX:  # not past float's range
                continue
        elif kind is bool:
            continue
        elif isinstance(value, Tensor) and a_real_number(name, value):
            if value.device.type != "cpu":  # another device's is read by the step there: looking would wait
                continue
            value = value.item()
            if -_FLOAT_MAX <= value < below and value <= _FLOAT_MAX:
                continue
        elif not a_real_number(name, value):
            raise ValueError(f"Invalid {name}: {value!r} (must be {NUMBER_TERMS if name == 'lr' else OPTION_TERMS})")
        else:
            value = one_value(name, value)  # a numpy number, or an array of one
            if -_FLOAT_MAX <= value < below and value <= _FLOAT_MAX:
                continue
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number"
                         + ("" if below == math.inf else f" below {below:g}") + ")")


_FLOAT_MAX = sys.float_info.max


def plain_values(group: dict, keys) -> dict:
    """The Python values of ``group``'s options ``keys`` that hold numpy values (``np.float32(0.1)``,
    ``np.True_``, an array of betas, a sequence of numpy numbers or arrays of one element, as a list), by key:
    a numpy fp32
    number's arithmetic rounds to fp32, where the native rules and a compiled step take its value.

    An option whose default is no sequence, written as an array of one element (``lr=np.array([1e-3])``),
    is its one value, as a one-element tensor lr is; of more elements, a ValueError names it.

    Args:
        group: the param group, read.
        keys: the options to look at and their defaults (an algorithm's: the optimizer's ``defaults``),
            not a scheduler's keys (``initial_lr``), which it computes with as it likes.
    """
    found = {}
    for key in keys:  # no call per option: a bound Muon step reads its groups' options every step
        value = group.get(key)
        if isinstance(value, NUMPY_VALUES):
            found[key] = (list(map(functools.partial(item_value, key), value)) if isinstance(keys[key], (tuple, list))
                          and value.ndim else one_value(key, value))
        elif isinstance(value, (tuple, list)) and any(isinstance(v, NUMPY_VALUES) for v in value):
            found[key] = [item_value(key, v) if isinstance(v, NUMPY_VALUES) else v for v in value]
    return found


def item_value(name, item):
    """The Python value of ``item``, a numpy item of sequence option ``name``: its one value (an array of one
    element, a beta of a column of betas), or its list (a row of Muon's per-step coefficient triples)."""
    return one_value(name, item) if item.size == 1 else plain(item)


def plain_options(group: dict, keys) -> None:
    """Give ``group``'s options ``keys`` that hold numpy values their Python values (``plain_values``)
    in place, before a step is traced: dynamo hands the traced step's ops numpy numbers as values
    they cannot take, and ``prepare`` encodes the others as JSON. A list keeps its identity, a
    tuple its type (a namedtuple's too).

    Args:
        group: the param group, changed in place where an option holds numpy values.
        keys: the options to look at (see ``plain_values``).
    """
    for key, value in plain_values(group, keys).items():
        set_option(group, key, value)


def set_option(group: dict, key: str, value) -> None:
    """Give ``group``'s option ``key`` the value ``value``: a list it holds keeps its identity (items set in
    place), a tuple its type (a namedtuple's too)."""
    held = group[key]
    if isinstance(held, list):
        held[:] = value
    elif isinstance(held, tuple):
        group[key] = held._make(value) if hasattr(held, "_make") else tuple(value)
    else:
        group[key] = value


def check_grads(name: str, params: list, grads: list, signature=None) -> None:
    """Raise a RuntimeError if a gradient is sparse, is its param's own memory (``param.grad = param``:
    the fused kernels would read it as they write the param) or does not match its param: the same
    shape, dtype and device (one device for the whole group). The fast test runs over all of them at
    once, against the params' ``signature`` (``step_cache.Signature``) where there is one.

    Args:
        name: the optimizer's class name, which the messages begin with.
        params: the params with grads, as the engines update them.
        grads: their grads, alike.
        signature: the params' layouts when their step work was made, or None.
    """
    if (signature is not None and signature.one_device
            and all(map(operator.is_, map(attrgetter("layout"), grads), repeat(torch.strided)))
            and signature.matches(grads, SHAPE, DTYPE, DEVICE)
            and not any(map(operator.eq, map(Tensor.data_ptr, grads), signature.values[Tensor.data_ptr]))):
        return
    for param, grad in zip(params, grads):
        if grad.layout != torch.strided:
            raise RuntimeError(f"{name} does not support sparse gradients")
        if grad.numel() and grad.data_ptr() == param.data_ptr():
            raise RuntimeError(f"{name}: a gradient is its param's own memory (param.grad = param?), which a step "
                               "reads as it writes the param: give the grad memory of its own (.clone())")
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            raise RuntimeError(
                f"{name}: a gradient must match its parameter; got grad {grad.dtype} {tuple(grad.shape)} "
                f"on {grad.device} for param {param.dtype} {tuple(param.shape)} on {param.device}")
    devices = {param.device for param in params}
    if len(devices) > 1:
        raise RuntimeError(f"{name}: all params of a group must be on one device, got {sorted(map(str, devices))}")


def beta_fits(beta) -> bool:
    """Whether ``beta`` is a number in [0, 1) as the constructor takes one: an int or a float, a real numpy
    number or array of one element (its value: :func:`one_value`), not a Fraction or a Decimal (which a
    foreach step's ops refuse midway, helper-96), or a 0-d floating-point tensor (a step's scalar tensors
    of one dimension hold one value per param), in [0, 1) where it is on the CPU (a step reads another
    device's there: looking here would wait for it)."""
    if isinstance(beta, Tensor):
        return beta.dim() == 0 and beta.is_floating_point() and (beta.device.type != "cpu" or 0 <= beta.item() < 1)
    if isinstance(beta, NUMPY_VALUES):
        if beta.size != 1 or beta.dtype.kind not in "iuf":
            return False
        beta = one_value("betas", beta)
    return isinstance(beta, (float, int)) and not isinstance(beta, bool) and 0.0 <= beta < 1.0
