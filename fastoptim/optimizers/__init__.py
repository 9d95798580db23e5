from .adamw import AdamW
from .adamwsn import AdamWSN, RMSPropSN
from .adan import Adan

__all__ = ["Adan", "AdamW", "AdamWSN", "RMSPropSN"]
