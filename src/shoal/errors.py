"""The one exception tree of shoal.

    ShoalError                      every error shoal raises on purpose
    ├── InvalidRequest              the caller sent something we cannot serve; fix the request
    │   ├── UnknownModel            the model id is not in the catalog (or off the token's allow-list)
    │   ├── UnsupportedMediaType    Content-Type is neither JSON nor msgpack
    │   ├── PayloadTooLarge         the body exceeds the server's limit
    │   ├── ResultTooLarge          the response would exceed the server's limit; split the request
    │   └── InputTooLong            an item has more tokens than the model takes (truncate: false)
    ├── Unauthorized                no bearer token, or one this server does not know (401)
    ├── Forbidden                   the token may not do this: an admin route, a download (403)
    ├── Overloaded                  the queue is full, a model is loading, the device restarts; retry later
    │   ├── NoWorker                no live worker of the cluster serves the model (yet: scale from zero)
    │   └── QueueUnavailable        the cluster's work queue (NATS) is unreachable from the gateway
    ├── DeadlineExceeded            the call's deadline passed before it was served; names the phase
    ├── Cancelled                   the caller went away; its remaining work was dropped
    ├── InferenceFailed             the model failed on some items (the server log has the traceback)
    ├── ConfigError                 the settings ask for something this machine lacks (a GPU)
    ├── CardError                   a model card (YAML) is malformed; names the file and field
    ├── ModelLoadError              weights or tokenizer could not be found or loaded (502; back off)
    └── DeadLetter                  the cluster delivered the call max_deliver times and no worker answered (502)

Each error carries a stable `code` (a short snake_case string), optional `details` and, for
Overloaded, `retry_after_s`. `error_from_code` rebuilds the same class from those fields, so an
error that crossed a process boundary (the cluster's wire) re-raises as itself. The mapping to HTTP
status lives in exactly one place: `shoal.api.errors`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping


class ShoalError(Exception):
    code = "internal_error"

    def __init__(self, message: str, *, details: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, object] = dict(details or {})  # JSON values: the error body's `details`

    @property
    def retry_after_s(self) -> float | None:
        """Seconds after which a retry may succeed; None: retrying the same call will not help."""
        return None


class InvalidRequest(ShoalError):
    code = "invalid_request"


class UnknownModel(InvalidRequest):
    code = "unknown_model"

    @classmethod
    def named(cls, model_id: str, known: Iterable[str]) -> UnknownModel:
        """The error for `model_id`, echoing at most 200 characters of it and suggesting up to three
        close ids of `known` (only ids the caller may see: a suggestion tells that a model exists)."""
        shown = model_id if len(model_id) <= 200 else model_id[:200] + "…"
        close = difflib.get_close_matches(model_id[:200], list(known), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return cls(
            f"unknown model {shown!r}{hint} (GET /v1/models lists the models this server serves)",
            details={"model": shown, **({"suggestions": close} if close else {})},
        )


class UnsupportedMediaType(InvalidRequest):
    code = "unsupported_media_type"


class PayloadTooLarge(InvalidRequest):
    code = "payload_too_large"


class ResultTooLarge(InvalidRequest):
    code = "result_too_large"


class InputTooLong(InvalidRequest):
    code = "input_too_long"


class Unauthorized(ShoalError):
    code = "unauthorized"


class Forbidden(ShoalError):
    code = "forbidden"


class Overloaded(ShoalError):
    code = "overloaded"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, details: Mapping[str, object] | None = None
    ) -> None:
        super().__init__(message, details=details)
        self._retry_after_s = retry_after_s

    @property
    def retry_after_s(self) -> float:
        return self._retry_after_s


class NoWorker(Overloaded):
    code = "no_worker"


class QueueUnavailable(Overloaded):
    code = "queue_unavailable"


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
    """`public_message` is what a client sees: the message with the server's file paths cut to
    their last part (the log gets the whole message). `retry_after_s`: when the next attempt is.
    `permanent`: trying again cannot help until someone changes the server (installs the weights,
    allows downloads, fixes the adapter's files): answered without a Retry-After, so clients do
    not retry it."""

    code = "model_load_failed"

    def __init__(
        self,
        message: str,
        *,
        details: Mapping[str, object] | None = None,
        public_message: str | None = None,
        retry_after_s: float | None = None,
        permanent: bool = False,
    ) -> None:
        super().__init__(message, details=details)
        self.public_message = public_message or _PATH.sub(lambda m: m.group(0).rsplit("/", 1)[-1], message)
        self._retry_after_s = retry_after_s
        self.permanent = permanent

    @property
    def retry_after_s(self) -> float | None:
        return self._retry_after_s


class DeadLetter(ShoalError):
    """Every delivery of the call ended without an answer (its workers died or timed out on it)."""

    code = "dead_letter"


# An absolute path (or ~/...) in a message: a server's internals, not for its clients.
_PATH = re.compile(r"(?<![\w.])~?/[^\s:;,'\"()]+")


def _all_classes(cls: type[ShoalError]) -> list[type[ShoalError]]:
    return [cls] + [c for sub in cls.__subclasses__() for c in _all_classes(sub)]


_BY_CODE: dict[str, type[ShoalError]] = {cls.code: cls for cls in _all_classes(ShoalError)}


def error_from_code(
    code: str, message: str, details: Mapping[str, object] | None = None, retry_after_s: float | None = None
) -> ShoalError:
    """The error of class `code` (ShoalError for a code this version does not know)."""
    cls = _BY_CODE.get(code, ShoalError)
    if issubclass(cls, Overloaded):
        error: ShoalError = cls(message, retry_after_s=retry_after_s or 1.0, details=details)
    elif issubclass(cls, ModelLoadError):
        error = cls(message, details=details, retry_after_s=retry_after_s)
    else:
        error = cls(message, details=details)
    if cls is ShoalError:
        error.code = code  # keep an unknown code as it was sent
    return error
