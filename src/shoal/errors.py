"""The one exception tree of shoal.

    ShoalError                      every error shoal raises on purpose
    ├── InvalidRequest              the caller sent something we cannot serve; fix the request
    │   ├── UnknownModel            the model id is not in the catalog
    │   ├── UnsupportedMediaType    Content-Type is neither JSON nor msgpack
    │   ├── PayloadTooLarge         the body exceeds the server's limit
    │   ├── ResultTooLarge          the response would exceed the server's limit; split the request
    │   └── InputTooLong            an item has more tokens than the model takes (truncate: false)
    ├── Overloaded                  the queue is full, a model is loading, the device restarts; retry later
    ├── DeadlineExceeded            the call's deadline passed before it was served; names the phase
    ├── Cancelled                   the caller went away; its remaining work was dropped
    ├── InferenceFailed             the model failed on some items (the server log has the traceback)
    ├── ConfigError                 the settings ask for something this machine lacks (a GPU)
    ├── CardError                   a model card (YAML) is malformed; names the file and field
    └── ModelLoadError              weights or tokenizer could not be found or loaded

Each error carries a stable `code` (a short snake_case string), optional `details` and, for
Overloaded, `retry_after_s`. `error_from_code` rebuilds the same class from those fields, so an
error that crossed a process boundary (the cluster's wire) re-raises as itself. The mapping to HTTP
status lives in exactly one place: `shoal.api.errors`.
"""

from __future__ import annotations

from typing import Any


class ShoalError(Exception):
    code = "internal_error"

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    @property
    def retry_after_s(self) -> float | None:
        """Seconds after which a retry may succeed; None: retrying the same call will not help."""
        return None


class InvalidRequest(ShoalError):
    code = "invalid_request"


class UnknownModel(InvalidRequest):
    code = "unknown_model"


class UnsupportedMediaType(InvalidRequest):
    code = "unsupported_media_type"


class PayloadTooLarge(InvalidRequest):
    code = "payload_too_large"


class ResultTooLarge(InvalidRequest):
    code = "result_too_large"


class InputTooLong(InvalidRequest):
    code = "input_too_long"


class Overloaded(ShoalError):
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details=details)
        self._retry_after_s = retry_after_s

    @property
    def retry_after_s(self) -> float:
        return self._retry_after_s


class DeadlineExceeded(ShoalError):
    code = "deadline_exceeded"


class Cancelled(ShoalError):
    code = "cancelled"


class InferenceFailed(ShoalError):
    code = "inference_failed"


class ConfigError(ShoalError):
    code = "invalid_config"


class CardError(ShoalError):
    code = "invalid_model_card"


class ModelLoadError(ShoalError):
    code = "model_load_failed"


def _all_classes(cls: type[ShoalError]) -> list[type[ShoalError]]:
    return [cls] + [c for sub in cls.__subclasses__() for c in _all_classes(sub)]


_BY_CODE: dict[str, type[ShoalError]] = {cls.code: cls for cls in _all_classes(ShoalError)}


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None,
                    retry_after_s: float | None = None) -> ShoalError:
    """The error of class `code` (ShoalError for a code this version does not know)."""
    cls = _BY_CODE.get(code, ShoalError)
    if issubclass(cls, Overloaded):
        error: ShoalError = cls(message, retry_after_s=retry_after_s or 1.0, details=details)
    else:
        error = cls(message, details=details)
    if cls is ShoalError:
        error.code = code  # keep an unknown code as it was sent
    return error
