from .adamw import AdamW
from .adamwsn import AdamWSN, RMSPropSN
from .adan import Adan
from .lion import Lion
from .muon import Muon

__all__ = ["Adan", "AdamW", "AdamWSN", "RMSPropSN", "Lion", "Muon"]
