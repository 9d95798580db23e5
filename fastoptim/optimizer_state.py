"""An optimizer's state dicts, as torch.optim's, which count their changes (:class:`OptimizerState`,
:class:`ParamState`): a step tells that no state was replaced or removed without looking at each, and a
count written as a number is kept as torch.optim loads one."""
import numbers
import weakref
from collections import defaultdict

import torch
from torch import Tensor


def _changed(state):
    """Count a change in the OptimizerState that ``state`` is, or in those that hold it (a ParamState's
    ``owners``, weak references: strong ones would make a cycle, and an optimizer's states would wait
    for the garbage collector)."""
    for owner in [state] if type(state) is OptimizerState else [ref() for ref in state.owners]:
        if owner is not None:
            owner.changes += 1


MUTATORS = ("__setitem__", "__delitem__", "__ior__", "clear", "pop", "popitem", "setdefault", "update")


def _counting_changes(cls):
    """``cls`` (a dict type) with each of its ``MUTATORS`` that it takes from its dict type as it is
    counting a change."""
    def counting(method):
        def counted(self, *args, **kwargs):
            _changed(self)
            return method(self, *args, **kwargs)
        counted.__name__ = method.__name__
        return counted
    base = next(base for base in cls.__mro__ if base in (dict, defaultdict))
    for name in MUTATORS:
        if getattr(cls, name) is getattr(base, name):
            setattr(cls, name, counting(getattr(base, name)))
    return cls


class _WritingThrough:
    """A dict type's ``update`` and ``|=`` writing each value through its ``__setitem__`` (dict's own
    bypass it), every value taken (``_taken``: what ``__setitem__`` keeps of it, or a ValueError) before
    any is written: a refused one leaves the dict as it was."""

    def update(self, /, *values, **kwargs):
        taken = [(key, self._taken(key, value)) for key, value in dict(*values, **kwargs).items()]
        for key, value in taken:
            self[key] = value

    def __ior__(self, values):
        self.update(values)
        return self


def _as_count(key, value):
    """``value`` written under ``key``; a ``"step"`` written as a real number (official Adan and timm keep
    ints; an int subclass, a numpy number) as a 0-d fp32 CPU tensor, whatever the default device and
    dtype (a step moves it to its param's device): torch.compile's guards of an optimizer's state take
    no number for a count, and fail inside dynamo on one, as they do on any other value of no count (a
    bool, None, text, a complex number, an int past float's range), which is refused here, as it is
    written. The step refuses by name, eager or compiled, a count that is no whole number >= 0 (see
    ``StateCreation._check_state``)."""
    if key != "step" or isinstance(value, Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid step: {value!r} (a step count must be a number or a 0-d tensor)")
    try:
        return torch.tensor(float(value), dtype=torch.float32, device="cpu")
    except OverflowError:
        raise ValueError(f"Invalid step: {value!r} (a step count must be within float's range)") from None


@_counting_changes
class ParamState(_WritingThrough, dict):
    """A param's state dict, as torch.optim's, which counts its changes in the OptimizerStates that hold it,
    so a step can tell that none of its states was replaced or removed without looking at each. A count
    written as a number is kept as a tensor (see ``_as_count``), as torch.optim loads one."""

    owners = ()  # weak references to the OptimizerStates that hold it
    _taken = staticmethod(_as_count)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "step" in self:
            dict.__setitem__(self, "step", _as_count("step", dict.__getitem__(self, "step")))

    def __setitem__(self, key, value):
        value = _as_count(key, value)
        if key not in self or dict.__getitem__(self, key) is not value:  # dynamo sets counts to themselves
            _changed(self)
        super().__setitem__(key, value)

    def setdefault(self, key, value=None):
        if key not in self:
            self[key] = value
        return self[key]

    def __reduce__(self):
        return ParamState, (dict(self),)


@_counting_changes
class OptimizerState(_WritingThrough, defaultdict):
    """An optimizer's ``state``: param to its :class:`ParamState` (a dict stored in it becomes one,
    a copy), counting its changes and theirs in ``changes`` (a compiled step's guard and a bound
    step's rule). Like torch's ``defaultdict(dict)``, it takes any other key and value
    too (torch's own state-dict hooks keep ``state["test"] = 1``), kept as they are."""

    def __init__(self, states=()):
        super().__init__(ParamState)
        self.changes = 0
        # the params whose state dict was assigned whole since the optimizer last took them (a checkpoint's,
        # as ZeroRedundancyOptimizer loads one: its master remainder goes with the param's value as loaded)
        self.assigned = weakref.WeakValueDictionary()
        for param, state in dict(states).items():
            self._store(param, state)

    @staticmethod
    def _taken(param, state):
        """``state`` as it is kept: a dict as a :class:`ParamState` (which refuses a count of no number)."""
        return ParamState(state) if isinstance(state, dict) and type(state) is not ParamState else state

    def __setitem__(self, param, state):
        """``state`` assigned whole: noted in ``assigned`` where it is another dict than the param's."""
        if isinstance(param, Tensor) and state is not dict.get(self, param):
            self.assigned[id(param)] = param
        self._store(param, state)

    def _store(self, param, state):
        state = self._taken(param, state)  # before the change is counted: a refused count changes nothing
        if isinstance(state, dict):
            if not any(ref() is self for ref in state.owners):  # a state dict two optimizers hold counts for both
                state.owners = [ref for ref in state.owners if ref() is not None] + [weakref.ref(self)]
        _changed(self)
        super().__setitem__(param, state)

    def __missing__(self, param):  # a read of a param without a state, which makes one: no assignment
        self._store(param, {})
        return dict.__getitem__(self, param)

    def setdefault(self, param, state=None):
        if param not in self:
            self._store(param, {} if state is None else state)
        return self[param]

    def __reduce__(self):
        return OptimizerState, (dict(self),)

    def copy(self):  # defaultdict's would call OptimizerState(default_factory, self)
        return OptimizerState(self)

    __copy__ = copy
