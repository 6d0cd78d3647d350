"""The engine: admission, tokenization, token-budget scheduling and one device thread per device.

`Engine` is the public surface; `types` holds the torch-free request and batch types.
"""

from .engine import Engine
from .types import EncodeCall, EncodeResult

__all__ = ["EncodeCall", "EncodeResult", "Engine"]
