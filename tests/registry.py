"""The optimizers under test, one entry each, after torch's ``OptimizerInfo``. The generic tests
that read this list (bad input, the torch.optim contract, the kernel specs, the adversarial cases,
the reliability findings, the fused engines' fallbacks, state dicts and exact betas) run on every
entry, so an optimizer's own test file holds only its own facts. The hypothesis tests of
test_engines.py and test_triton.py draw each one's options from its entry too."""
import inspect
from dataclasses import dataclass, field

from hypothesis import strategies as st

import fastoptim


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer as the generic tests take it. ``exact_betas``: betas that fp32 holds exactly,
    as it does 1 − β, so that a kernel and the loop engine differ only in the order of fp32
    operations (none: it takes no ``betas`` tuple). ``second_moment``: whether it keeps one, so
    that ``sn`` applies. ``sign_update``: its update is a sign, so another fp32 rounding of the
    same math may move an element by 2·lr instead of a few ulps (its own tests bound how often).
    ``own_options``: options of its own that change its math, which the generic tests combine with
    the options every optimizer takes."""

    cls: type
    exact_betas: tuple
    second_moment: bool = True
    sign_update: bool = False
    own_options: dict = field(default_factory=dict)

    @property
    def name(self):
        return self.cls.__name__

    def takes(self, option):
        """Whether its constructor takes ``option``."""
        return option in inspect.signature(self.cls).parameters

    def __repr__(self):
        return self.name

    def drawn_own_options(self):
        """Hypothesis strategies of its own options, each at its default or as ``own_options`` sets it."""
        parameters = inspect.signature(self.cls).parameters
        return {name: st.sampled_from([parameters[name].default, value]) for name, value in self.own_options.items()}

    def variant(self):
        """Its own options with the lean and cross-cutting ones every optimizer takes: 8-bit states,
        clipping, maximize, and subset-norm second moments where it keeps one."""
        return self.own_options | dict(state_bits=8, max_grad_norm=0.5, maximize=True) | (
            dict(sn=True) if self.second_moment else {})


ADAN = OptimizerInfo(fastoptim.Adan, exact_betas=((1 - 2**-6, 1 - 2**-4, 1 - 2**-7), (0.875, 0.75, 1 - 2**-10)),
                     own_options=dict(no_prox=True))
ADAMW = OptimizerInfo(fastoptim.AdamW, exact_betas=((1 - 2**-3, 1 - 2**-10), (0.75, 1 - 2**-7)),
                      own_options=dict(amsgrad=True))
ADAMWSN = OptimizerInfo(fastoptim.AdamWSN, exact_betas=ADAMW.exact_betas, own_options=dict(correct_bias=False))
RMSPROPSN = OptimizerInfo(fastoptim.RMSPropSN, exact_betas=(), own_options=dict(correct_bias=False))
LION = OptimizerInfo(fastoptim.Lion, exact_betas=((0.875, 1 - 2**-7),), second_moment=False, sign_update=True)

OPTIMIZERS = (ADAN, ADAMW, ADAMWSN, RMSPROPSN, LION)
# Those that take betas as a tuple (RMSPropSN takes beta2 alone).
WITH_BETAS = tuple(info for info in OPTIMIZERS if info.exact_betas)
