"""Loaded models by id: lazy loading, LRU eviction by bytes, pins, in-flight refcounts.

- A cold model loads on first use, in a loader thread; concurrent requests share that one load.
- Before a load, least-recently-used models are evicted until the new one fits the memory budget.
  Pinned models and models with requests in flight are never evicted.
- A request waits up to `load_timeout_s` for a load, then gets Overloaded (503 + Retry-After);
  the load goes on, and the retry finds the model warm.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..catalog import ModelCard
from ..errors import ModelLoadError, Overloaded


class ModelCache:
    def __init__(
        self,
        load: Callable[[ModelCard], Any],
        estimate_bytes: Callable[[ModelCard], int],
        *,
        memory_budget_bytes: int | None,
        pinned: frozenset[str] = frozenset(),
        load_timeout_s: float = 120.0,
    ) -> None:
        self._load_fn = load
        self._estimate_fn = estimate_bytes
        self._budget = memory_budget_bytes
        self._pinned = pinned
        self._load_timeout_s = load_timeout_s
        self._loaded: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Task] = {}
        self._inflight: Counter[str] = Counter()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-load")
        # One load at a time: each load makes room knowing every byte already committed.
        self._load_lock = asyncio.Lock()

    def is_loaded(self, model_id: str) -> bool:
        return model_id in self._loaded

    @property
    def num_loaded(self) -> int:
        return len(self._loaded)

    @property
    def loaded_bytes(self) -> int:
        return sum(r.num_bytes for r in self._loaded.values())

    async def acquire(self, card: ModelCard) -> Any:
        """The loaded model, counted in flight until `release(card.id)`."""
        self._inflight[card.id] += 1
        try:
            runner = self._loaded.get(card.id)
            if runner is None:
                task = self._loading.get(card.id)
                if task is None:
                    task = self._loading[card.id] = asyncio.create_task(self._load(card))
                runner = await asyncio.wait_for(asyncio.shield(task), self._load_timeout_s)
            self._loaded.move_to_end(card.id)
            return runner
        except asyncio.TimeoutError:
            self.release(card.id)
            raise Overloaded(f"model {card.id} is still loading; retry shortly", retry_after_s=5.0) from None
        except BaseException:
            self.release(card.id)
            raise

    def release(self, model_id: str) -> None:
        self._inflight[model_id] -= 1
        if self._inflight[model_id] <= 0:
            del self._inflight[model_id]

    async def _load(self, card: ModelCard) -> Any:
        loop = asyncio.get_running_loop()
        try:
            async with self._load_lock:
                if self._budget is not None:
                    needed = await loop.run_in_executor(self._executor, self._estimate_fn, card)
                    self._make_room(card.id, needed)
                runner = await loop.run_in_executor(self._executor, self._load_fn, card)
                self._loaded[card.id] = runner
                return runner
        finally:
            del self._loading[card.id]

    def _make_room(self, model_id: str, needed: int) -> None:
        assert self._budget is not None
        if needed > self._budget:
            raise ModelLoadError(
                f"model {model_id} needs {needed} bytes, more than the memory budget of {self._budget}",
                details={"model": model_id, "needed_bytes": needed, "memory_budget_bytes": self._budget},
            )
        used = self.loaded_bytes
        for victim in list(self._loaded):
            if used + needed <= self._budget:
                break
            if victim in self._pinned or self._inflight[victim] > 0:
                continue
            runner = self._loaded.pop(victim)
            used -= runner.num_bytes
            runner.close()
        if used + needed > self._budget:
            raise Overloaded(f"no room to load {model_id}: the models in memory are pinned or busy", retry_after_s=2.0)

    def close(self) -> None:
        for runner in self._loaded.values():
            runner.close()
        self._loaded.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
