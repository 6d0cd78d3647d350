"""The one exception tree of shoal.

    ShoalError                      every error shoal raises on purpose
    ├── InvalidRequest              the caller sent something we cannot serve; fix the request
    │   ├── UnknownModel            the model id is not in the catalog
    │   ├── UnsupportedMediaType    Content-Type is neither JSON nor msgpack
    │   ├── PayloadTooLarge         the body exceeds the server's limit
    │   └── InputTooLong            an item has more tokens than the model takes (truncate: false)
    ├── Overloaded                  the queue is full or a model is still loading; retry later
    ├── ConfigError                 the settings ask for something this machine lacks (a GPU)
    ├── CardError                   a model card (YAML) is malformed; names the file and field
    └── ModelLoadError              weights or tokenizer could not be found or loaded

Each error carries a stable `code` (a short snake_case string) and optional `details`. The mapping
to HTTP status lives in exactly one place: `shoal.api.errors`.
"""

from __future__ import annotations

from typing import Any


class ShoalError(Exception):
    code = "internal_error"

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class InvalidRequest(ShoalError):
    code = "invalid_request"


class UnknownModel(InvalidRequest):
    code = "unknown_model"


class UnsupportedMediaType(InvalidRequest):
    code = "unsupported_media_type"


class PayloadTooLarge(InvalidRequest):
    code = "payload_too_large"


class InputTooLong(InvalidRequest):
    code = "input_too_long"


class Overloaded(ShoalError):
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details=details)
        self.retry_after_s = retry_after_s


class ConfigError(ShoalError):
    code = "invalid_config"


class CardError(ShoalError):
    code = "invalid_model_card"


class ModelLoadError(ShoalError):
    code = "model_load_failed"
