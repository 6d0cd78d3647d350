"""The engine: the in-process Service. Admission by tokens, deadlines, tasks per verb, the
tokenizer pool, the fair token-budget scheduler and one device thread per device.
"""

from ..calls import EncodeCall, EncodeResult, ExtractCall, ExtractResult, ScoreCall, ScoreResult
from .engine import Engine

__all__ = ["EncodeCall", "EncodeResult", "Engine", "ExtractCall", "ExtractResult", "ScoreCall", "ScoreResult"]
