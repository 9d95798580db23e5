"""Peer optimizers that are not importable the ordinary way."""
import importlib
import importlib.util
import sys
import types
from pathlib import Path


def timm_adan_class():
    """timm's Adan, loaded by file path: importing the timm package would import torchvision."""
    spec = importlib.util.find_spec("timm")
    if spec is None:
        raise RuntimeError("timm's Adan is a peer; scripts/setup.sh installs it (pip install --no-deps timm)")
    if "_timm_optim" not in sys.modules:
        package = types.ModuleType("_timm_optim")
        package.__path__ = [str(Path(spec.submodule_search_locations[0]) / "optim")]
        sys.modules["_timm_optim"] = package
    return importlib.import_module("_timm_optim.adan").Adan
