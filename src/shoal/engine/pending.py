"""One request's sequences on their way through the device (engine/device.py): what the
scheduler reads to batch them, what the lanes write as batches run, and the timings the result
reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from ..errors import ShoalError
from .backend import LoadedModel
from .types import Encoded, Spec


class Pending:
    """One request's sequences on their way through the device, resolved on the event loop."""

    def __init__(
        self,
        model_id: str,
        runner: LoadedModel,
        seqs: Sequence[Encoded],
        specs: Sequence[Spec],
        *,
        deadline: float,
        request_id: str | None,
        future: asyncio.Future,
        on_released: Callable[[], None] | None = None,
        adapter_slot: int = -1,
    ) -> None:
        self.model_id = model_id
        self.adapter_slot = adapter_slot  # the runner's slot of the request's LoRA adapter; -1: the base model
        self.runner = runner  # held (refcounted by the cache) until the device lets go of it
        # Called on the loop once the device will never touch this request again (done, dropped
        # or failed): only then may the cache evict its model.
        self.on_released = on_released
        self.released = False
        self.large = False  # more tokens than a "small" request (set by the device on submit)
        self.seqs, self.specs = seqs, specs
        self.lengths = [len(s) for s in seqs]
        self.deadline = deadline
        self.request_id = request_id
        self.future = future
        self.next_index = 0  # scheduler state
        self.outputs: list[object] = [None] * len(seqs)
        # Written by the lanes with the device's lock held:
        self.remaining = len(seqs)  # sequences not yet run
        self.in_batches = 0  # batches running with some of its sequences
        self.dropped = False  # the scheduler let go of its unscheduled sequences (cancelled, late, failed)
        self.error: ShoalError | None = None
        self.enqueued_at = time.perf_counter()
        self._batches: list[tuple[float, float]] = []  # (start, end) of each batch it was in (perf_counter)
        self.finished_at: float | None = None

    @property
    def cancelled(self) -> bool:
        return self.future.done() or self.error is not None

    def ran(self, start: float, end: float) -> None:
        """One of its batches ran from `start` to `end` (called by that batch's lane, the lock held)."""
        self._batches.append((start, end))

    @property
    def inference_s(self) -> float:
        """Time some batch of it was running: batches on other lanes overlap, so they count once."""
        total, until = 0.0, float("-inf")
        for start, end in sorted(self._batches):
            total += max(0.0, end - max(start, until))
            until = max(until, end)
        return total

    @property
    def queue_s(self) -> float:
        end = self.finished_at or time.perf_counter()
        return max(0.0, end - self.enqueued_at - self.inference_s)
