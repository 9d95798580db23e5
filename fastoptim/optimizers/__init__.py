from .adamw import AdamW
from .adan import Adan

__all__ = ["Adan", "AdamW"]
