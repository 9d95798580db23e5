"""The optimizers under test, one entry each, after torch's ``OptimizerInfo``. The generic tests
that read this list (bad input, the torch.optim contract, the kernel specs, the adversarial cases,
the reliability findings, the fused engines' fallbacks, state dicts and exact betas) run on every
entry, so an optimizer's own test file holds only its own facts. Not all generic tests read it
yet: tests/test_compile.py and test_triton.py still list their classes, and test_engines.py's
hypothesis tests draw options per algorithm."""
import inspect
from dataclasses import dataclass

import fastoptim


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer as the generic tests take it. ``exact_betas``: betas that fp32 holds exactly,
    as it does 1 − β, so that a kernel and the loop engine differ only in the order of fp32
    operations (none: it takes no ``betas`` tuple). ``second_moment``: whether it keeps one, so
    that ``sn`` applies. ``sign_update``: its update is a sign, so another fp32 rounding of the
    same math may move an element by 2·lr instead of a few ulps (its own tests bound how often)."""

    cls: type
    exact_betas: tuple
    second_moment: bool = True
    sign_update: bool = False

    @property
    def name(self):
        return self.cls.__name__

    def takes(self, option):
        """Whether its constructor takes ``option``."""
        return option in inspect.signature(self.cls).parameters

    def __repr__(self):
        return self.name


ADAN = OptimizerInfo(fastoptim.Adan, exact_betas=((1 - 2**-6, 1 - 2**-4, 1 - 2**-7), (0.875, 0.75, 1 - 2**-10)))
ADAMW = OptimizerInfo(fastoptim.AdamW, exact_betas=((1 - 2**-3, 1 - 2**-10), (0.75, 1 - 2**-7)))
ADAMWSN = OptimizerInfo(fastoptim.AdamWSN, exact_betas=ADAMW.exact_betas)
RMSPROPSN = OptimizerInfo(fastoptim.RMSPropSN, exact_betas=())
LION = OptimizerInfo(fastoptim.Lion, exact_betas=((0.875, 1 - 2**-7),), second_moment=False, sign_update=True)

OPTIMIZERS = (ADAN, ADAMW, ADAMWSN, RMSPROPSN, LION)
# Those that take betas as a tuple (RMSPropSN takes beta2 alone).
WITH_BETAS = tuple(info for info in OPTIMIZERS if info.exact_betas)
