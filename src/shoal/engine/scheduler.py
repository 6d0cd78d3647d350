"""The token-budget scheduler: pure bookkeeping, no threads, no tensors.

Requests queue per model, each with its sequences in order. `next_batch` is fair at two levels:

- **across models**: models take turns, one batch each, in a ring (a model with a bulk job and a
  model with one query alternate, so neither waits on more than one batch of the other);
- **within a model**: the batch takes one sequence from each waiting request in turn, round after
  round, until the token budget (`max_batch_tokens`, real tokens) or `max_batch_items` is reached.
  A 2,048-text request shares every batch with the one-text requests that arrived after it
  instead of holding them back until it is done.

Each batch starts its rounds after the request served last, and a request whose next sequence
did not fit goes first in the next batch, so no request is passed over for long (a sequence larger
than the whole budget runs alone). Requests whose caller went away (`cancelled`) or whose
deadline passed are dropped before they cost a batch slot and handed back, so the caller can
answer them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """One request's sequences waiting for the device."""

    model_id: str
    deadline: float  # time.monotonic() seconds
    next_index: int  # the first sequence not yet handed to a batch

    @property
    def lengths(self) -> Sequence[int]:  # real tokens per sequence
        ...

    @property
    def cancelled(self) -> bool: ...


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_items: int
    # An idle device waits up to this long for more of the model's work before cutting a batch
    # smaller than the limits (0: never waits).
    batch_wait_s: float = 0.0


# One batch slot: sequence `index` of `request`.
Slot = tuple[Q, int]


class Scheduler(Generic[Q]):
    """Cuts batches from the queued requests of type Q (the device's Pending)."""

    def __init__(self, limits_for: Callable[[str], BatchLimits]) -> None:
        self._limits_for = limits_for
        self._queues: dict[str, deque[Q]] = {}
        self._ring: deque[str] = deque()  # models in turn order
        self._last_served: str | None = None
        self._num_seqs = 0
        self._num_tokens = 0

    def __len__(self) -> int:
        """Sequences waiting (those of dropped-but-not-yet-seen requests included)."""
        return self._num_seqs

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def next_model(self) -> str | None:
        """The model whose turn is next (None: nothing waits)."""
        return self._ring[0] if self._ring else None

    def limits_of(self, model_id: str) -> BatchLimits:
        return self._limits_for(model_id)

    def add(self, request: Q) -> None:
        if request.model_id not in self._queues:
            self._queues[request.model_id] = deque()
            # Just before the model served last: a newcomer never waits on a repeat turn.
            served = self._last_served
            last = self._ring.index(served) if served is not None and served in self._ring else len(self._ring)
            self._ring.insert(last, request.model_id)
        self._queues[request.model_id].append(request)
        self._count(request, +1)

    def next_batch(self, now: float, max_tokens: int | None = None) -> tuple[list[Slot[Q]], list[Q]]:
        """(the next batch, the requests dropped on the way: cancelled or past their deadline).

        `max_tokens` cuts the batch below the model's token budget (a device lane's share of the
        queued work). The batch is empty when nothing live is waiting."""
        dropped: list[Q] = []
        while self._ring:
            model_id = self._ring[0]
            queue = self._queues[model_id]
            for request in [r for r in queue if r.cancelled or r.deadline <= now]:
                queue.remove(request)
                self._count(request, -1)
                dropped.append(request)
            if not queue:
                self._ring.popleft()
                del self._queues[model_id]
                continue
            self._ring.rotate(-1)  # this model's turn is taken
            self._last_served = model_id
            limits = self._limits_for(model_id)
            if max_tokens is not None and max_tokens < limits.max_batch_tokens:
                limits = replace(limits, max_batch_tokens=max(1, max_tokens))
            return self._fill(queue, limits), dropped
        return [], dropped

    def drain(self) -> list[Q]:
        """Every waiting request, removed (the device is stopping or died)."""
        requests = [r for q in self._queues.values() for r in q]
        self._queues.clear()
        self._ring.clear()
        self._num_seqs = self._num_tokens = 0
        return requests

    def _fill(self, queue: deque[Q], limits: BatchLimits) -> list[Slot[Q]]:
        batch: list[Slot[Q]] = []
        num_tokens = 0
        blocked: Q | None = None  # the first request whose next sequence did not fit
        last: Q | None = None  # the request served last, where the next batch starts after
        progress = True
        while progress and len(batch) < limits.max_batch_items and num_tokens < limits.max_batch_tokens:
            progress = False
            for request in queue:  # one sequence from each request per round
                if request.next_index >= len(request.lengths):
                    continue
                length = request.lengths[request.next_index]
                if batch and num_tokens + length > limits.max_batch_tokens:
                    blocked = blocked or request  # a shorter one of another request may fit
                    continue
                batch.append((request, request.next_index))
                request.next_index += 1
                num_tokens += length
                self._num_seqs -= 1
                self._num_tokens -= length
                last, progress = request, True
                if len(batch) >= limits.max_batch_items or num_tokens >= limits.max_batch_tokens:
                    break
        # Next batch: the blocked request first (it keeps its place), then those after the last
        # one served; so neither a long sequence nor a late request can be passed over forever.
        if last is not None:
            queue.rotate(-(queue.index(last) + 1))
        if blocked is not None:
            queue.remove(blocked)
            queue.appendleft(blocked)
        for request in [r for r in queue if r.next_index >= len(r.lengths)]:
            queue.remove(request)  # fully handed out; completion is the caller's business
        return batch

    def _count(self, request: Q, sign: int) -> None:
        rest = request.lengths[request.next_index :]
        self._num_seqs += sign * len(rest)
        self._num_tokens += sign * sum(rest)
