"""A load that failed, and the error every request gets until its next attempt (engine/cache.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import ModelLoadError

MAX_BACKOFF_S = 60.0  # the back-off doubles per failure up to this


@dataclass
class Failure:
    error: ModelLoadError
    attempts: int
    retry_at: float  # time.monotonic()


def retry_later(failure: Failure) -> ModelLoadError:
    """The failure's error again, with the seconds until the next attempt; a permanent one without
    them (no Retry-After: a client's retry cannot help, and the SDK does not retry it)."""
    if failure.error.permanent:
        return failure.error
    wait_s = max(1.0, failure.retry_at - time.monotonic())
    details = {**failure.error.details, "retry_after_s": round(wait_s, 1)}
    return ModelLoadError(
        f"{failure.error.message}; the next attempt is in {wait_s:.0f} s", details=details, retry_after_s=wait_s
    )
