"""The token-budget scheduler: pure bookkeeping, no threads, no tensors.

Items queue per model. `next_batch` serves the model whose oldest item waited longest, then takes
that model's items oldest first while the sum of their real tokens fits `max_batch_tokens` and
their count fits `max_batch_items`. The item that would overflow stays at the front for the next
batch. Cancelled items (their request went away) are dropped before they cost a batch slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol


class Schedulable(Protocol):
    model_id: str
    seq: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_items: int


class Scheduler:
    def __init__(self, limits_for: Callable[[str], BatchLimits]) -> None:
        self._limits_for = limits_for
        self._queues: dict[str, deque[Schedulable]] = {}
        self._num_items = 0

    def __len__(self) -> int:
        """Items waiting, cancelled ones included until they are dropped."""
        return self._num_items

    def add(self, items: list[Schedulable]) -> None:
        for item in items:
            self._queues.setdefault(item.model_id, deque()).append(item)
        self._num_items += len(items)

    def next_batch(self) -> list[Schedulable]:
        """The next batch to run, or [] when nothing live is waiting."""
        self._drop_cancelled_heads()
        if not self._queues:
            return []
        model_id = min(self._queues, key=lambda m: self._queues[m][0].seq)
        queue, limits = self._queues[model_id], self._limits_for(model_id)
        batch: list[Schedulable] = []
        num_tokens = 0
        while queue and len(batch) < limits.max_batch_items:
            item = queue[0]
            if item.cancelled:
                queue.popleft()
                self._num_items -= 1
                continue
            if batch and num_tokens + item.num_tokens > limits.max_batch_tokens:
                break  # stays at the front for the next batch
            batch.append(queue.popleft())
            self._num_items -= 1
            num_tokens += item.num_tokens
        if not queue:
            del self._queues[model_id]
        return batch

    def _drop_cancelled_heads(self) -> None:
        for model_id in list(self._queues):
            queue = self._queues[model_id]
            while queue and queue[0].cancelled:
                queue.popleft()
                self._num_items -= 1
            if not queue:
                del self._queues[model_id]
