"""Admission: what the engine accepts, counted from admit until answered.

Three bounds, each refused with a reason:

    items, tokens  the queue's `max_queue_items` / `max_queue_tokens`   503 (a request alone over
                                                                        either: 400, split it)
    time           the backlog's seconds plus the request's own, at     503, Retry-After: the
                   each model's measured rate, within `max_queue_s`     seconds until the backlog
                   (or the call's timeout, if shorter)                  has drained enough, and
                                                                        the refused before it
                                                                        have had their turn

Time is what a caller waits for, and tokens are a poor proxy for it: a million tokens is two
minutes of MiniLM on two cores and hours of a decoder. The backlog is kept in tokens per model and
turned into seconds when asked, at the rates the device measures (engine/device.py), so it follows
the device as it speeds up or slows down. What is ahead of a request is its own model's backlog
and, of each other model's, at most as much again as that and the request take: models take turns
on the device (engine/scheduler.py), so a bulk job on one model does not hold another model's
one-sentence requests out. Within a model, requests take turns too; a request longer than the
bound by itself (a bulk job) counts ahead of a later one of its model only as much as that one and
the rest of the model's backlog take, so it does not hold its own model's small requests out
either. Requests within the bound count in full, so those still finish within it. Those rates are
of the forwards alone: what surrounds them (parsing, tokenizing, answering) is not counted, which
matters for bursts of many tiny requests (a batch of 4 short texts: admitted work took up to 1.2
times the bound in the test).

Retry-After is a promise kept for a crowd, not for one caller: were every refused request told
the time at which the backlog alone would let it in, a burst's hundreds of refused requests would
all be told the same second and all but a few refused again then. So each refusal books its own
seconds on a timeline of promised retries and is told the first time past the earlier bookings; a
burst's refused requests are spread over the time their work takes, and come back to a backlog
with room for them (unless newcomers took it first: the timeline is not a reservation). Bookings
err late by PROMISE_MARGIN, as the estimate errs short. Bookings in the past cost nothing, so the
timeline is back to now once the refused have had their turn.

A request longer than the bound by itself is not refused for ever: it is admitted when the backlog
ahead of it is under a quarter of the bound. One that could not finish within its own deadline
even with the device to itself (twice its timeout at the measured rate: the estimate is rough) is
refused at once with a 400 rather than run to a 504, if it needs `HOPELESS_MIN_S` or more: a
request smaller than that is not too big, its deadline is too short (through a gateway the
worker sees only what is left of it), and it is answered as any late call, 503 or 504. Until a
model's first batch has run there is no rate for it (the device-wide rate of other models stands
in, if any): admission counts tokens only, and the engine checks time again once the request is
tokenized.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InvalidRequest, Overloaded

# A request longer than the bound may wait behind this share of it.
LONG_REQUEST_WAIT_SHARE = 0.25
# Refused at once only when alone it needs more than this many times its timeout, and this many
# seconds or more.
HOPELESS_FACTOR = 2.0
HOPELESS_MIN_S = 1.0
# Promised retries are booked this much later and longer than the estimate says: the estimate
# counts the device's forwards alone and runs short by up to a quarter under a burst, and a client
# refused again at its told time loses more than one told a little late.
PROMISE_MARGIN = 1.25


@dataclass
class Admission:
    """The admitted, unanswered work. `rate_of(model_id)` is the device's tokens/s for a model
    (None before one is measured)."""

    max_items: int
    max_tokens: int
    max_seconds: float | None
    rate_of: Callable[[str], float | None]
    clock: Callable[[], float] = time.monotonic
    items: int = 0
    tokens: int = 0
    _tokens_of: dict[str, int] = field(default_factory=dict)
    # The token counts of each model's admitted requests longer than the bound by themselves.
    _long_of: dict[str, Counter[int]] = field(default_factory=dict)
    # Clock time up to which the promised retries (Retry-After told so far) are booked.
    _promised_until: float = float("-inf")

    # --- counting --------------------------------------------------------------------------------

    def add(self, model_id: str, items: int, tokens: int) -> None:
        self.items += items
        self.tokens += tokens
        self._tokens_of[model_id] = self._tokens_of.get(model_id, 0) + tokens

    def remove(self, model_id: str, items: int, tokens: int) -> None:
        self.add(model_id, -items, -tokens)
        if items:
            self._forget_long(model_id, tokens)
        if self._tokens_of.get(model_id) == 0:
            del self._tokens_of[model_id]
            self._long_of.pop(model_id, None)

    def seconds(self, model_id: str, tokens: int) -> float | None:
        """`tokens` of a model in device seconds; None while no rate is known."""
        rate = self.rate_of(model_id)
        return tokens / rate if rate else None

    def backlog_s(self) -> float:
        """Seconds of admitted work (models without a rate yet count nothing)."""
        return sum(self.seconds(m, t) or 0.0 for m, t in self._tokens_of.items())

    def ahead_s(self, model_id: str, own_s: float, counted_tokens: int = 0) -> float:
        """Seconds of admitted work ahead of a request of `own_s` on `model_id` (`counted_tokens`
        of it already in the backlog): its model's backlog, a long request of it counting at most
        as much as the rest and this one take, and of each other model's at most as much as all
        that, since requests and models take turns on the device."""
        rate = self.rate_of(model_id)
        if not rate:
            return 0.0
        total = max(0, self._tokens_of.get(model_id, 0) - counted_tokens)
        longs = Counter(self._long_of.get(model_id, {}))
        if counted_tokens and longs[counted_tokens] > 0:  # the request itself, on its second look
            longs[counted_tokens] -= 1
        short_s = max(0, total - sum(t * n for t, n in longs.items())) / rate
        mine_s = min(total / rate, short_s + sum(n * min(t / rate, short_s + own_s) for t, n in longs.items()))
        others_s = sum(
            min(self.seconds(m, t) or 0.0, mine_s + own_s) for m, t in self._tokens_of.items() if m != model_id
        )
        return mine_s + others_s

    # --- deciding --------------------------------------------------------------------------------

    def admit(self, model_id: str, items: int, tokens: int, timeout_s: float) -> None:
        """Count a request in, or raise why not (Overloaded with its Retry-After; InvalidRequest
        for one that can never be admitted)."""
        if items > self.max_items:  # could never be admitted: a retry would not help
            raise InvalidRequest(
                f"{items} items in one request is more than the queue holds ({self.max_items}); split the request",
                details={"items": items, "max_queue_items": self.max_items},
            )
        if tokens > self.max_tokens:
            raise InvalidRequest(
                f"about {tokens} tokens in one request is more than the queue holds ({self.max_tokens}); "
                "split the request",
                details={"estimated_tokens": tokens, "max_queue_tokens": self.max_tokens},
            )
        over_items = self.items + items - self.max_items
        over_tokens = self.tokens + tokens - self.max_tokens
        if over_items > 0 or over_tokens > 0:
            retry_after_s = self._promise(self._retry_after_full(over_items, over_tokens), model_id, tokens)
            raise Overloaded(
                f"the queue is full ({self.items} items, about {self.tokens} tokens waiting; "
                f"limit {self.max_items} items, {self.max_tokens} tokens); retry in {retry_after_s:.0f} s",
                retry_after_s=retry_after_s,
                details={"queued_items": self.items, "queued_tokens": self.tokens},
            )
        self.check_time(model_id, tokens, timeout_s)
        self.add(model_id, items, tokens)
        self._note_long(model_id, tokens)

    def recount(self, model_id: str, estimated: int, real: int, timeout_s: float, *, timed: bool) -> None:
        """A request's real token count (once tokenized) in place of its estimate: refused if it
        overflows the queue, or (when it grew, or it was admitted before a rate was known: not
        `timed`) if it would not finish in time after all."""
        over_tokens = self.tokens + real - estimated - self.max_tokens
        if real > estimated and over_tokens > 0:
            retry_after_s = self._promise(self._retry_after_full(0, over_tokens), model_id, real)
            raise Overloaded(
                f"the queue is full (about {self.tokens} tokens waiting, and this request has {real}); "
                f"retry in {retry_after_s:.0f} s",
                retry_after_s=retry_after_s,
                details={"queued_tokens": self.tokens},
            )
        if real > estimated or not timed:
            self.check_time(model_id, real, timeout_s, counted_tokens=estimated)
        self.add(model_id, 0, real - estimated)
        self._forget_long(model_id, estimated)
        self._note_long(model_id, real)

    def _note_long(self, model_id: str, tokens: int) -> None:
        """Count an admitted request of `tokens` among its model's long ones, if longer than the bound."""
        own_s = self.seconds(model_id, tokens)
        if self.max_seconds is not None and own_s is not None and own_s > self.max_seconds:
            self._long_of.setdefault(model_id, Counter())[tokens] += 1

    def _forget_long(self, model_id: str, tokens: int) -> None:
        longs = self._long_of.get(model_id)
        if longs and longs[tokens] > 0:
            longs[tokens] -= 1
            if not longs[tokens]:
                del longs[tokens]

    def check_time(self, model_id: str, tokens: int, timeout_s: float, *, counted_tokens: int = 0) -> None:
        """Raise if `tokens` more of the model would not finish within the bound behind the
        backlog. `counted_tokens`: the request's own, already in the backlog (a second look)."""
        own_s = self.seconds(model_id, tokens)
        if self.max_seconds is None or own_s is None:
            return
        if own_s > HOPELESS_FACTOR * timeout_s and own_s >= HOPELESS_MIN_S:
            raise InvalidRequest(
                f"this request needs about {own_s:.0f} s of the device at its measured rate, more than "
                f"its deadline allows ({timeout_s:g} s): split it, or give it a longer timeout_s",
                details={"estimated_s": round(own_s, 1), "timeout_s": timeout_s},
            )
        bound_s = min(self.max_seconds, timeout_s)
        ahead_s = self.ahead_s(model_id, own_s, counted_tokens)
        may_wait_s = max(bound_s - own_s, LONG_REQUEST_WAIT_SHARE * bound_s)
        if ahead_s <= may_wait_s:
            return
        retry_after_s = self._promise(ahead_s - may_wait_s, model_id, tokens)
        raise Overloaded(
            f"the server is busy: about {ahead_s:.0f} s of admitted work is ahead of this request, "
            f"which needs about {own_s:.1f} s, and requests are admitted to finish within "
            f"{bound_s:g} s; retry in {retry_after_s:.0f} s",
            retry_after_s=retry_after_s,
            details={"backlog_s": round(ahead_s, 1), "estimated_s": round(own_s, 1), "max_queue_s": bound_s},
        )

    def _promise(self, wait_s: float, model_id: str, tokens: int) -> float:
        """Retry-After (whole seconds, at least 1) for a refused request of `tokens` that the
        backlog alone would let in after `wait_s`: the first time past the retries already
        promised, whose timeline this request's own seconds then extend."""
        now = self.clock()
        at = max(now + PROMISE_MARGIN * wait_s, self._promised_until)
        self._promised_until = at + PROMISE_MARGIN * (self.seconds(model_id, tokens) or 0.0)
        return float(max(1, math.ceil(at - now)))

    def _retry_after_full(self, over_items: int, over_tokens: int) -> float:
        """Seconds until enough of the backlog has run to admit the request (items or tokens), at
        the measured rates; 0 while none is measured."""
        backlog_s = self.backlog_s()
        if not backlog_s or not self.tokens:
            return 0.0
        tokens_per_item = self.tokens / max(1, self.items)
        to_drain = max(over_tokens, over_items * tokens_per_item, 0)
        return backlog_s * to_drain / self.tokens
