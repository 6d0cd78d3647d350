"""The simulated fleet of bench/cluster.py: its devices (`SimDevice`, `Cost`) and its load (`Workload`).

A `SimDevice` is a `Service` whose batches cost modelled time instead of running a model:

    run(call) ─ its model loaded? ─ yes ─▶ the engine's own Scheduler (engine/scheduler.py): models
              │                            take turns, a batch takes one item of each waiting call
              │                            in turn up to the token budget; a bulk call is cut into
              │                            many batches and shares them with small calls
              └ no ─▶ waits for a load: the oldest such call's model is loaded as soon as a slot is
                      free or an idle model (no call in flight) can be evicted, least recently used
                      first; the load costs `swap_s` of device time (busy, not useful) and counts
                      as a swap; past its deadline a waiting call fails (as the engine's does)

    a batch costs batch_s + token_s × tokens (+ switch_s when its model is not the last batch's),
    spent in asyncio.sleep; while a large call (> 1,024 tokens) is live and small ones arrived in
    the last 5 s, batches are cut to about `target_batch_s` (the engine's `target_batch_s`)

`resident` None keeps every model loaded (no loads, no swaps). The device reports what a Worker
and a router read: `capacity()` (its measured tokens/s), `model(id).loaded`, and counters (useful
busy seconds, swaps and their seconds, tokens run).

`Workload` is the seeded list of calls every dispatcher gets: encode calls of 1-8 texts of 4-48
pseudo-words (queries), and with `bulk_share` that share of calls a bulk call of `bulk_items`
texts (log-uniform between the two bounds), each call's model drawn by a Zipf law.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
from dataclasses import dataclass

import msgspec
import numpy as np

from shoal.calls import EncodeCall, EncodedItem, EncodeResult, text_of
from shoal.engine.scheduler import BatchLimits, Scheduler
from shoal.errors import DeadlineExceeded, InvalidRequest, UnknownModel
from shoal.metrics import Metrics
from shoal.service import Capacity, CardProblem, ModelStatus
from shoal.verbs import estimate_tokens

MAX_QUEUED_TOKENS = 1_000_000
MAX_BATCH_ITEMS = 256  # the engine's default max_batch_items
# The engine's: a call over this many tokens is large; small ones seen this recently cut batches by time.
LARGE_CALL_TOKENS = 1024
CONTENTION_WINDOW_S = 5.0
MIN_BATCH_TOKENS = 256
# A call with more items than this is bulk (the queries have 1-8).
QUERY_ITEMS = 8


@dataclass(frozen=True)
class Cost:
    """What one batch costs a simulated device, in seconds (slowdown applied); `swap_s` is a load."""

    batch_s: float
    token_s: float
    switch_s: float
    max_batch_tokens: int
    swap_s: float = 0.0

    def of(self, num_tokens: int, switched: bool) -> float:
        return self.batch_s + self.token_s * num_tokens + (self.switch_s if switched else 0.0)

    @property
    def peak_tokens_per_s(self) -> float:
        """Full batches of one model, back to back."""
        return self.max_batch_tokens / max(1e-9, self.of(self.max_batch_tokens, False))


def item_tokens(text: str) -> int:
    """One text's tokens on the simulated device (the gateway's estimate is the call's characters / 4)."""
    return max(1, len(text) // 4)


class _Pending:
    """One call on the device: what the engine's Scheduler reads (`Queued`), and its progress."""

    def __init__(self, model_id: str, lengths: list[int], arrived: float, deadline: float, future) -> None:
        self.model_id = model_id
        self.lengths = lengths
        self.tokens = sum(lengths)
        self.arrived = arrived
        self.deadline = deadline
        self.future: asyncio.Future = future  # (queue_s, inference_s); a cancelled caller cancels it
        self.next_index = 0  # the Scheduler's: the first item not yet handed to a batch
        self.done_items = 0
        self.started: float | None = None

    @property
    def cancelled(self) -> bool:
        return self.future.done()


class SimDevice:
    """A `Service` over a batch-cost model (see the module docstring)."""

    def __init__(
        self,
        name: str,
        model_ids: list[str],
        cost: Cost,
        resident: int | None = None,
        target_batch_s: float | None = None,
    ) -> None:
        self.name = name
        self.cost = cost
        self.slots = resident  # models held loaded at most; None: all, always
        self.target_batch_s = target_batch_s
        self.metrics = Metrics()
        self._statuses = {
            m: ModelStatus(
                id=m,
                tasks=("encode",),
                outputs=("dense",),
                max_length=512,
                verified="simulated",
                loaded=True,
                state="loaded",
                architecture="sim",
            )
            for m in model_ids
        }
        limits = BatchLimits(cost.max_batch_tokens, MAX_BATCH_ITEMS)
        self._scheduler: Scheduler[_Pending] = Scheduler(lambda model_id: limits)
        self._loaded: collections.OrderedDict[str, None] = collections.OrderedDict(
            (m, None) for m in (model_ids if resident is None else [])
        )  # least recently used first
        self._inflight: collections.Counter[str] = collections.Counter()  # calls admitted per model
        self._cold: collections.deque[_Pending] = collections.deque()  # calls waiting for a load
        self._large_live = 0
        self._small_seen_at = -1e9
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_model: str | None = None
        self._rate: float | None = None  # tokens/s of recent batches (the engine's 0.8/0.2 average)
        self.queued_tokens = 0
        self.running_tokens = 0
        # What the host reports: modelled useful seconds (batches), loads and their seconds, seconds
        # the event loop overslept the model, work done.
        self.busy_s = 0.0
        self.swaps = 0
        self.swap_s = 0.0
        self.overslept_s = 0.0
        self.tokens = 0

    @property
    def outstanding_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens

    @property
    def resident_models(self) -> list[str]:
        return list(self._loaded)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"sim {self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def warm(self, model_ids: list[str]) -> None:
        """Preloads (free, before the run), up to the slots."""
        for model_id in model_ids:
            self.model(model_id)
            if self.slots is not None and model_id not in self._loaded and len(self._loaded) < self.slots:
                self._loaded[model_id] = None

    @property
    def ready(self) -> bool:
        return self._task is not None

    def models(self) -> list[ModelStatus]:
        return [self.model(m) for m in self._statuses]

    def model(self, model_id: str) -> ModelStatus:
        if model_id not in self._statuses:
            raise UnknownModel(f"{model_id} is not simulated here")
        status = self._statuses[model_id]
        if self.slots is None:
            return status
        loaded = model_id in self._loaded
        return msgspec.structs.replace(status, loaded=loaded, state="loaded" if loaded else "not_loaded")

    def has_model(self, model_id: str) -> bool:
        return model_id in self._statuses

    def problems(self) -> list[CardProblem]:
        return []

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        return self.model(model_id)

    async def tokenize(
        self, model_id: str, texts: list[str], add_special_tokens: bool = True, prompt_name: str | None = None
    ):
        raise InvalidRequest("a simulated device has no tokenizer")

    def capacity(self) -> Capacity:
        return Capacity(self.outstanding_tokens, MAX_QUEUED_TOKENS, self._rate)

    async def run(self, call) -> EncodeResult:
        loop = asyncio.get_running_loop()
        self.model(call.model)
        now = loop.time()
        lengths = [item_tokens(text_of(item) or "") for item in call.items]
        pending = _Pending(call.model, lengths, now, now + (call.timeout_s or 300.0), loop.create_future())
        self.queued_tokens += pending.tokens
        if pending.tokens > LARGE_CALL_TOKENS:
            self._large_live += 1
        else:
            self._small_seen_at = now
        if call.model in self._loaded:
            self._admit(pending)
        else:
            self._cold.append(pending)
        self._wake.set()
        try:
            queue_s, inference_s = await pending.future
        finally:
            if pending.tokens > LARGE_CALL_TOKENS:
                self._large_live -= 1
        return EncodeResult(
            items=[EncodedItem()] * len(lengths), num_tokens=pending.tokens, queue_s=queue_s, inference_s=inference_s
        )

    def _admit(self, pending: _Pending) -> None:
        self._inflight[pending.model_id] += 1
        self._scheduler.add(pending)

    def _finish(self, pending: _Pending, error: Exception | None = None) -> None:
        """Out of the device: its unrun tokens leave the queue count, its model's in-flight count."""
        self.queued_tokens -= sum(pending.lengths[pending.next_index :])
        self._inflight[pending.model_id] -= 1
        if not pending.future.done():
            if error is not None:
                pending.future.set_exception(error)
            else:
                started = pending.started if pending.started is not None else pending.arrived
                pending.future.set_result((started - pending.arrived, self._now() - started))

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # --- loads ----------------------------------------------------------------------------------

    def _next_load(self, now: float) -> tuple[str, str | None] | None:
        """(model to load, model to evict or None): for the oldest call waiting for a load, once a
        slot is free or an idle model can go. Calls past their deadline or cancelled leave first."""
        while self._cold and (self._cold[0].cancelled or self._cold[0].deadline <= now):
            gone = self._cold.popleft()
            self.queued_tokens -= gone.tokens
            if not gone.future.done():
                gone.future.set_exception(DeadlineExceeded("expired waiting for its model's load"))
        if not self._cold or self.slots is None:
            return None
        model_id = self._cold[0].model_id
        if len(self._loaded) < self.slots:
            return model_id, None
        idle = next((m for m in self._loaded if not self._inflight[m]), None)
        return (model_id, idle) if idle is not None else None

    async def _load(self, model_id: str, evict: str | None) -> None:
        if evict is not None:
            del self._loaded[evict]
        await asyncio.sleep(self.cost.swap_s)
        self._loaded[model_id] = None
        self.swaps += 1
        self.swap_s += self.cost.swap_s
        waiting = [pending for pending in self._cold if pending.model_id == model_id]
        for pending in waiting:
            self._cold.remove(pending)
            if not pending.cancelled:
                self._admit(pending)
            else:
                self.queued_tokens -= pending.tokens

    # --- batches --------------------------------------------------------------------------------

    def _max_tokens(self) -> int | None:
        """The engine's cut while large and small calls share the device: about target_batch_s."""
        contended = self._large_live > 0 and self._now() - self._small_seen_at < CONTENTION_WINDOW_S
        if not (self.target_batch_s and contended):
            return None
        timed = (self.target_batch_s - self.cost.batch_s) / max(1e-12, self.cost.token_s)
        return max(MIN_BATCH_TOKENS, int(timed))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            load = self._next_load(now)
            if load is not None:
                await self._load(*load)
                continue
            slots, dropped = self._scheduler.next_batch(now, self._max_tokens())
            for pending in dropped:
                self._finish(pending, DeadlineExceeded("expired in the simulated device's queue"))
            if not slots:
                self._wake.clear()
                if self._cold:  # waiting for a model in flight to go idle, or a deadline
                    try:
                        await asyncio.wait_for(self._wake.wait(), max(0.001, self._cold[0].deadline - now))
                    except asyncio.TimeoutError:
                        pass
                else:
                    await self._wake.wait()
                continue
            model = slots[0][0].model_id
            if model in self._loaded:
                self._loaded.move_to_end(model)
            num_tokens = sum(pending.lengths[index] for pending, index in slots)
            cost = self.cost.of(num_tokens, self._last_model not in (None, model))
            self._last_model = model
            self.queued_tokens -= num_tokens
            self.running_tokens = num_tokens
            started = loop.time()
            for pending, _ in slots:
                if pending.started is None:
                    pending.started = started
            await asyncio.sleep(cost)
            elapsed = loop.time() - started
            self.running_tokens = 0
            self.busy_s += cost
            self.overslept_s += elapsed - cost
            self.tokens += num_tokens
            if elapsed > 0:
                rate = num_tokens / elapsed
                self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
            for pending, _ in slots:
                pending.done_items += 1
                if pending.done_items == len(pending.lengths):  # (a call dropped part-run never gets here)
                    self._finish(pending)


# --- the load -------------------------------------------------------------------------------------


class Workload:
    """Seeded encode calls (see the module docstring): queries of 1-8 texts and, with `bulk_share`,
    bulk calls of `bulk_items` texts; models by a Zipf law."""

    def __init__(
        self,
        model_ids: list[str],
        zipf_s: float,
        timeout_s: float,
        seed: int = 0,
        bulk_share: float = 0.0,
        bulk_items: tuple[int, int] = (64, 2048),
        bulk_timeout_s: float | None = None,
    ) -> None:
        rng = random.Random(seed)
        words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 10))) for _ in range(3000)]
        texts = [" ".join(rng.choices(words, k=rng.randint(4, 48))) for _ in range(5000)]
        weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(model_ids))]
        self.shares = [w / sum(weights) for w in weights]
        low, high = bulk_items
        self.calls: list[EncodeCall] = []
        for _ in range(20_000):
            model = rng.choices(model_ids, weights)[0]
            if bulk_share and rng.random() < bulk_share:
                num_items = min(high, round(math.exp(rng.uniform(math.log(low), math.log(high)))))
                items = [texts[rng.randrange(len(texts))] for _ in range(num_items)]
                self.calls.append(EncodeCall(model=model, items=items, timeout_s=bulk_timeout_s or timeout_s))
            else:
                self.calls.append(
                    EncodeCall(model=model, items=rng.sample(texts, rng.randint(1, 8)), timeout_s=timeout_s)
                )
        tokens = [estimate_tokens(c, None) for c in self.calls]  # the gateway's estimate, without a card
        self.mean_tokens = float(np.mean(tokens))
        queries = [t for c, t in zip(self.calls, tokens) if not is_bulk(c)]
        self.query_mean_tokens = float(np.mean(queries))
        self.bulk_token_share = 1.0 - sum(queries) / sum(tokens)
        self._at = 0

    def rewind(self) -> None:
        self._at = 0

    def next(self) -> EncodeCall:
        self._at = (self._at + 1) % len(self.calls)
        return self.calls[self._at]


def is_bulk(call) -> bool:
    return len(call.items) > QUERY_ITEMS
