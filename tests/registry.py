"""The optimizers under test, one entry each, after torch's ``OptimizerInfo``. The generic tests
that read this list (bad input, the torch.optim contract, the kernel specs, the adversarial cases,
the reliability findings, the fused engines' fallbacks, state dicts and exact betas) run on every
entry, so an optimizer's own test file holds only its own facts. The hypothesis tests of
test_engines.py and test_triton.py draw each one's options from its entry too."""
import inspect
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from torch import Tensor

import fastoptim
from fastoptim.measure import muon_groups


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer as the generic tests take it. ``exact_betas``: betas that fp32 holds exactly,
    as it does 1 − β, so that a kernel and the loop engine differ only in the order of fp32
    operations (none: it takes no ``betas`` tuple). ``second_moment``: whether it keeps one, so
    that ``sn`` applies. ``sign_update``: its update is a sign, so another fp32 rounding of the
    same math may move an element by 2·lr instead of a few ulps (its own tests bound how often).
    ``own_options``: options of its own that change its math, which the generic tests combine with
    the options every optimizer takes. ``param_dtypes``: those of its params
    on which every engine agrees with the loop engine to an ulp of the param. ``batches_matrices``: its
    foreach and fused engines multiply the matrices of one shape as one batch, which cuBLAS rounds
    apart from one matrix at a time for some shapes (docs/optimizers.md), on CUDA only."""

    cls: type
    exact_betas: tuple
    second_moment: bool = True
    sign_update: bool = False
    own_options: dict = field(default_factory=dict)
    param_dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)
    batches_matrices: bool = False

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



def by_use(group):
    """``group`` as param groups of Muon: as it is where it sets ``use_muon`` (or holds a bare
    tensor, which torch refuses), else its real matrices with Muon and the rest with AdamW."""
    params = group["params"]
    if "use_muon" in group or isinstance(params, Tensor):
        return [group]
    params = list(params)
    matrices = [param.dim() == 2 and not param.is_complex() for param in params]
    return [group | part for part in muon_groups(params, matrices)] or [group | {"params": params}]


class MuonWithCompanions(fastoptim.Muon):
    """Muon as a model's optimizer is built, for the generic tests, which hand it params as any
    optimizer takes them: of a list of params, or of a group that does not set ``use_muon``, the
    real matrices go in a Muon group and the others in a ``use_muon=False`` group (AdamW), so that
    a complex param and its real view (a 3-D param) both go to AdamW. tests/test_muon.py covers
    batches of matrices."""

    def __init__(self, params, *args, **kwargs):
        if isinstance(params, (list, tuple)) and params:
            groups = params if isinstance(params[0], dict) else [{"params": params}]
            params = [part for group in groups for part in by_use(group)]
        super().__init__(params, *args, **kwargs)

    def add_param_group(self, param_group):
        for part in by_use(param_group):
            super().add_param_group(part)


MuonWithCompanions.__signature__ = inspect.signature(fastoptim.Muon)  # what the tests read of its arguments


MUON = OptimizerInfo(MuonWithCompanions, exact_betas=ADAMW.exact_betas, second_moment=False,
                     own_options=dict(nesterov=False, adjust_lr_fn="match_rms_adamw"), batches_matrices=True,
                     # an fp16 direction rounds to fp16, then bf16, on the fused engines (as in torch.optim.Muon), and
                     # once on the loop engine, whose direction stays fp32: the iterations move an element by 2 ulps
                     param_dtypes=(torch.float32, torch.bfloat16))

OPTIMIZERS = (ADAN, ADAMW, ADAMWSN, RMSPROPSN, LION, MUON)
BY_CLASS = {info.cls: info for info in OPTIMIZERS}
# Those that take betas as a tuple (RMSPropSN takes beta2 alone).
WITH_BETAS = tuple(info for info in OPTIMIZERS if info.exact_betas)


def step_op(cls, param, grad, states, absmax, scalars, flags, per_tensor_calls=False):
    """Call ``cls``'s step op (``torch.ops.fastoptim.<spec name>_step``) with tensor lists by role:
    ``states`` and ``absmax`` one list per role of its spec, in order (an empty list: none)."""
    spec = cls.algorithm.spec
    tensors = {"param": param} | {role: values for role, values in zip(spec.states, states) if values}
    maxima = {role: values for role, values in zip(spec.states, absmax) if values}
    op = getattr(torch.ops.fastoptim, f"{spec.name}_step")
    op(param, grad, *fastoptim.engines.step_op.op_states(tensors, maxima, spec), scalars, flags, per_tensor_calls)
