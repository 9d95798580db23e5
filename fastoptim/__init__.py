"""fastoptim: Adan, AdamW, Lion, Muon and friends whose step costs what the memory bus allows."""
import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
# Each public name and the module that defines it, imported on first use: `import fastoptim` (and so the
# `fastoptim` command's --help) does not import torch until a name of it is used.
_DEFINED_IN = {"Adan": "optimizers", "AdamW": "optimizers", "AdamWSN": "optimizers", "RMSPropSN": "optimizers",
               "Lion": "optimizers", "Muon": "optimizers", "clip_grad_norm_": "clip",
               "flatten_parameters": "flat_params"}
# Submodules the docs use as attributes (``fastoptim.frameworks.muon_param_groups``), imported at first use too
_SUBMODULES = ("frameworks",)
__all__ = [*_DEFINED_IN, "__version__"]

if TYPE_CHECKING:  # what type checkers and editors see
    from .clip import clip_grad_norm_
    from .flat_params import flatten_parameters
    from .optimizers import AdamW, AdamWSN, Adan, Lion, Muon, RMSPropSN


def __getattr__(name: str):
    """A public name or submodule, imported from its module at first use (then a plain attribute)."""
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # which sets it as an attribute
    if name not in _DEFINED_IN:
        raise AttributeError(f"module 'fastoptim' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_DEFINED_IN[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_DEFINED_IN, *_SUBMODULES})
