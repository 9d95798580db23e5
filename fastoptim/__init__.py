"""fastoptim: Adan, AdamW, Lion, Muon and friends whose step costs what the memory bus allows."""
from .clip import clip_grad_norm_
from .flat_params import flatten_parameters
from .optimizers import AdamW, AdamWSN, Adan, Lion, Muon, RMSPropSN

__version__ = "0.1.0"
__all__ = ["Adan", "AdamW", "AdamWSN", "RMSPropSN", "Lion", "Muon", "clip_grad_norm_", "flatten_parameters",
           "__version__"]
