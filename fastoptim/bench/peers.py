"""Peer optimizers, built the way the benchmark steps them. A peer that is not installed raises
ImportError, which the benchmark reports as missing. Each is imported only when it is built, and
quietly (see fastoptim.extras.quiet_import)."""
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from ..extras import quiet_import
from ..measure import sn_groups

# the peers' libraries that pyproject's peers-gpu extra installs (GPU optimizers); the others are in peers
GPU_LIBRARIES = ("bitsandbytes", "torchao")


def timm_adan_class():
    """timm's Adan, loaded by file path: importing the timm package would import torchvision."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        raise ImportError("timm's Adan is a peer; scripts/setup.sh installs it (pip install --no-deps timm)")
    if "_timm_optim" not in sys.modules:
        package = types.ModuleType("_timm_optim")
        package.__path__ = [str(Path(spec.submodule_search_locations[0]) / "optim")]
        sys.modules["_timm_optim"] = package
    return importlib.import_module("_timm_optim.adan").Adan


def torch_adam(params, _sn, **options):
    return torch.optim.Adam(params, **options)


def torch_adamw(params, _sn, **options):
    return torch.optim.AdamW(params, **options)


class TorchMuonWithAdamW:
    """torch.optim.Muon on a model's hidden matrices and torch's fused AdamW on the rest, stepped
    together, as its users wire the two (torch's Muon takes 2-D params only)."""

    def __init__(self, params, matrices, **options):
        self.optimizers = [torch.optim.Muon([p for p, m in zip(params, matrices) if m], **options),
                           torch.optim.AdamW([p for p, m in zip(params, matrices) if not m], fused=True, **options)]
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        return {param: state for optimizer in self.optimizers for param, state in optimizer.state.items()}

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


def timm_adan(params, _sn, **options):
    return timm_adan_class()(params, foreach=True, **options)


def pytorch_optimizer_adan(params, _sn, **options):
    return quiet_import("pytorch_optimizer").Adan(params, **options)


def pytorch_optimizer_adamwsn(params, sn, **options):
    return quiet_import("pytorch_optimizer").AdamWSN(sn_groups(params, sn), **options)


def bitsandbytes_adamw8bit(params, _sn, **options):
    return quiet_import("bitsandbytes.optim").AdamW8bit(params, **options)


def torchao_adamw8bit(params, _sn, **options):
    return quiet_import("torchao.optim").AdamW8bit(params, **options)
