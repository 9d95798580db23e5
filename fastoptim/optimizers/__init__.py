from .adamw import AdamW
from .adamwsn import AdamWSN, RMSPropSN
from .adan import Adan
from .lion import Lion

__all__ = ["Adan", "AdamW", "AdamWSN", "RMSPropSN", "Lion"]
