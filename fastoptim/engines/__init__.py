"""How a step executes. Every engine runs an optimizer's ``update`` (its math, written once in
``fastoptim/optimizers``) over a :class:`Plan`; engines differ only in how they walk the tensors."""
from dataclasses import dataclass, field

from torch import Tensor

from . import foreach, loop


@dataclass
class Plan:
    """One bucket (one device and dtype) of one group's step.

    ``tensors`` maps a role (``param``, ``grad``, ``exp_avg``, ...) to one tensor per parameter.
    ``args`` holds the rest of ``update``'s keyword arguments: Python numbers and bools, 0-d tensors
    shared by every parameter, or 1-d tensors with one entry per parameter (named in ``per_tensor``).
    """

    tensors: dict[str, list[Tensor]]
    args: dict = field(default_factory=dict)
    per_tensor: frozenset = frozenset()

    def __len__(self):
        return len(self.tensors["param"])


AVAILABLE = {"loop": loop.run, "foreach": foreach.run}


def engine_name(foreach, fused):
    """The engine that a group's ``foreach``/``fused`` flags select, as the seeds choose it."""
    if fused:
        raise NotImplementedError("fused=True: the fused engines are not available yet; use fused=None or False")
    return "loop" if foreach is False else "foreach"
