"""Resident models (and their LoRA adapters) on one device, within one memory budget.

- A cold model loads on first use; concurrent requests share that one load. Its weights are
  fetched first (a Hub download, a package assembled) on fetch threads, outside the
  lock that serializes materializing weights: one slow download never holds up other cold loads.
- Each load makes room knowing every byte already committed: least-recently-used idle models are
  evicted (idle adapters first), never a pinned one and never one with work in flight. While only
  work in flight stands in the way, the load waits for it to end (outside the lock, within
  `load_timeout_s`); when nothing that may ever leave would make room, it fails at once. The
  bytes a model holds are **measured** once it is loaded (its tensors, not its files), and the
  device's workspace (the largest model's, once per batch the device runs side by side: once on
  a GPU, twice for a CPU's two lanes) comes on top; the budget is checked again against the
  measured figure.
- An adapter load holds its model (never evicts it), fails at once if the adapter cannot fit
  beside it, and backs off after a failure as models do.
- A request waits up to `load_timeout_s` for a load, then gets Overloaded (503) with a
  Retry-After from the model's measured load time; the load goes on and the retry finds it warm.
- A failed load answers ModelLoadError (502) to every waiter and, for a back-off that doubles per
  failure (1 s up to 60 s), to every new request without another attempt; then it is tried again.
- Pins (settings, cards, admin calls) and unloads by an operator; a model whose card changed is
  dropped once its in-flight work is done (new requests wait for that, then load the new card; a
  load of the old card still under way is dropped: each model has a generation). A changed
  adapter drains the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from ..catalog import ModelCard
from ..errors import InvalidRequest, ModelLoadError, Overloaded
from ..metrics import Metrics
from .backend import LoadedModel
from .cache_adapters import AdapterResidency
from .load_failures import MAX_BACKOFF_S, Failure, retry_later
from .threads import ThreadPerJob

log = logging.getLogger("shoal.cache")

_DEFAULT_LOAD_S = 5.0  # the Retry-After guess before any load was measured


class ModelCache(AdapterResidency):
    """Models resident on one device within its memory budget (the module's docstring); their
    adapters are AdapterResidency's (engine/cache_adapters.py)."""

    def __init__(
        self,
        load: Callable[[ModelCard], LoadedModel],
        estimate_bytes: Callable[[ModelCard], int],
        *,
        memory_budget_bytes: int | None,
        pinned: frozenset[str] = frozenset(),
        load_timeout_s: float = 30.0,
        fetch: Callable[[ModelCard], object] | None = None,
        load_backoff_s: float = 1.0,
        metrics: Metrics | None = None,
        device: str = "cpu",
        side_by_side: int = 1,
    ) -> None:
        self._load_fn = load
        self._estimate_fn = estimate_bytes
        self._fetch_fn = fetch
        self.budget_bytes = memory_budget_bytes
        self._pinned: set[str] = set(pinned)
        self._load_timeout_s = load_timeout_s
        self._backoff_s = load_backoff_s
        self._metrics = metrics
        self._device = device
        self._side_by_side = side_by_side  # batches the device may run at once (its lanes)
        self._loaded: OrderedDict[str, LoadedModel] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Task] = {}
        self._loading_since: dict[str, float] = {}
        self._inflight: Counter[str] = Counter()
        self._failures: dict[str, Failure] = {}
        self._load_s: dict[str, float] = {}  # measured seconds of each model's last load
        self._measured: dict[str, tuple[int, int]] = {}  # (bytes, workspace) each model measured last
        self._drop_when_idle: dict[str, str] = {}  # model id -> why (unload, changed)
        # Adapters: (model id, adapter name) least recently used first; in-flight counts.
        self._adapters: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._adapter_inflight: Counter[tuple[str, str]] = Counter()
        self._adapter_loading: dict[tuple[str, str], asyncio.Task] = {}
        self._adapter_stale: set[tuple[str, str]] = set()  # changed on disk: dropped once idle
        self._adapter_failures: dict[tuple[str, str], Failure] = {}
        # A thread per job, ended with it: a pooled thread that ran torch would keep an OpenMP team
        # and slow the device thread's forward (engine/threads.py).
        self._executor = ThreadPerJob(max_workers=1, thread_name_prefix="shoal-load")
        self._fetchers = ThreadPerJob(max_workers=4, thread_name_prefix="shoal-fetch")
        # One materialization at a time: each makes room knowing every byte already committed.
        self._load_lock = asyncio.Lock()
        # Set (and replaced by a fresh one) when a model or adapter's last work in flight ends, a
        # model leaves or a pin goes: a waiter takes the current event before it looks at the state.
        self._released = asyncio.Event()
        self._generation: Counter[str] = Counter()  # bumped when a model's card changes

    # --- what is resident -----------------------------------------------------------------------

    def is_loaded(self, model_id: str) -> bool:
        return model_id in self._loaded

    def is_loading(self, model_id: str) -> bool:
        return model_id in self._loading

    def runner(self, model_id: str) -> LoadedModel | None:
        return self._loaded.get(model_id)

    def is_pinned(self, model_id: str) -> bool:
        return model_id in self._pinned

    def failure(self, model_id: str) -> ModelLoadError | None:
        failure = self._failures.get(model_id)
        return failure.error if failure else None

    @property
    def loaded_bytes(self) -> int:
        """Bytes held now: each model's measured tensors and its resident adapters, plus the
        workspace of the largest once per batch the device runs side by side."""
        return sum(self.model_bytes(m) for m in self._loaded) + self._workspace(self._loaded.values())

    def model_bytes(self, model_id: str) -> int:
        runner = self._loaded.get(model_id)
        if runner is None:
            return 0
        return runner.num_bytes + sum(self._adapters[key] for key in self._adapters if key[0] == model_id)

    def adapters_of(self, model_id: str) -> tuple[str, ...]:
        return tuple(name for m, name in self._adapters if m == model_id)

    def _fixed_bytes(self, model_id: str) -> int:
        """What a resident model holds that no eviction of idle adapters frees: its tensors and its
        busy adapters."""
        runner = self._loaded[model_id]
        return runner.num_bytes + sum(
            size for key, size in self._adapters.items() if key[0] == model_id and self._adapter_inflight[key] > 0
        )

    def _workspace(self, runners, at_least: int = 0) -> int:
        """The largest of `runners`' batch workspaces (or `at_least`), once per batch the device
        runs side by side."""
        largest = max((getattr(r, "workspace_bytes", 0) for r in runners), default=0)
        return self._side_by_side * max(at_least, largest)

    # --- requests -------------------------------------------------------------------------------

    async def acquire(self, card: ModelCard, *, patient: bool = False) -> LoadedModel:
        """The loaded model, counted in flight until `release(card.id)`. A request waits up to
        `load_timeout_s` for a load; `patient` (preloading at start) waits for it to end."""
        if self._drop_when_idle.get(card.id) == "changed":  # the old card's model drains first
            await self._until(
                lambda: self._drop_when_idle.get(card.id) != "changed",
                None if patient else self._load_timeout_s,
                f"model {card.id} is reloading its changed card; retry shortly",
            )
        self._inflight[card.id] += 1
        try:
            runner = self._loaded.get(card.id)
            if runner is None:
                runner = await self._wait_for_load(card, patient)
            self._loaded.move_to_end(card.id)
            return runner
        except BaseException:
            self.release(card.id)
            raise

    def release(self, model_id: str) -> None:
        self._inflight[model_id] -= 1
        if self._inflight[model_id] <= 0:
            del self._inflight[model_id]
            reason = self._drop_when_idle.get(model_id)
            if reason == "changed" or (reason == "unload" and model_id not in self._pinned):
                self._evict(model_id, reason)
            self._notify()

    def _notify(self) -> None:
        event, self._released = self._released, asyncio.Event()
        event.set()

    async def _until(self, done: Callable[[], bool], timeout_s: float | None, message: str) -> None:
        """Wait for `done()`, re-checked whenever work in flight ends; Overloaded after `timeout_s`."""
        give_up_at = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            event = self._released  # taken before the look: a change after it sets this one
            if done():
                return
            remaining = None if give_up_at is None else give_up_at - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise Overloaded(message, retry_after_s=2.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    async def _wait_for_load(self, card: ModelCard, patient: bool = False) -> LoadedModel:
        failure = self._failures.get(card.id)
        if failure is not None and time.monotonic() < failure.retry_at and card.id not in self._loading:
            raise retry_later(failure)
        task = self._loading.get(card.id)
        if task is None:
            task = self._loading[card.id] = asyncio.create_task(self._load(card))
            self._loading_since[card.id] = time.monotonic()
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(asyncio.shield(task), None if patient else self._load_timeout_s)
        except asyncio.TimeoutError:
            raise Overloaded(
                f"model {card.id} is still loading; retry in {self._retry_after_s(card.id):.0f} s",
                retry_after_s=self._retry_after_s(card.id),
                details={"model": card.id, "state": "loading"},
            ) from None
        finally:
            if self._metrics is not None:
                self._metrics.cold_start_wait_seconds.labels(card.id).observe(time.perf_counter() - started)

    def _retry_after_s(self, model_id: str) -> float:
        """Seconds until the load under way should be done, from the measured load time."""
        expected = self._load_s.get(model_id)
        if expected is None:
            expected = sum(self._load_s.values()) / len(self._load_s) if self._load_s else _DEFAULT_LOAD_S
        elapsed = time.monotonic() - self._loading_since.get(model_id, time.monotonic())
        return min(MAX_BACKOFF_S, max(1.0, expected - elapsed))

    # --- loading --------------------------------------------------------------------------------

    async def _load(self, card: ModelCard) -> LoadedModel:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        generation = self._generation[card.id]
        try:
            if self._fetch_fn is not None:  # downloads: concurrent, outside the lock
                await loop.run_in_executor(self._fetchers, self._fetch_fn, card)
            needed, workspace = self._measured.get(card.id, (None, 0))
            if needed is None and self.budget_bytes is not None:
                needed = await loop.run_in_executor(self._executor, self._estimate_fn, card)
            async with self._room(card.id, needed or 0, workspace):
                runner = await loop.run_in_executor(self._executor, self._load_fn, card)
                measured = (runner.num_bytes, runner.workspace_bytes)
                try:
                    if self._generation[card.id] != generation:  # its card changed while it loaded
                        raise Overloaded(
                            f"the card of {card.id} changed while it loaded; retry",
                            retry_after_s=1.0,
                            details={"model": card.id},
                        )
                    self._measured[card.id] = measured
                    # The measured figure may pass the estimate: room again, now without waiting.
                    if self.budget_bytes is not None and not self._evict_for(card.id, *measured):
                        raise Overloaded(
                            f"no room for {card.id}: it measured {measured[0]} bytes and the models "
                            "in memory are busy; retry shortly",
                            retry_after_s=2.0,
                            details={"model": card.id},
                        )
                except BaseException:
                    runner.close()
                    raise
                self._loaded[card.id] = runner
            self._failures.pop(card.id, None)
            self._load_s[card.id] = seconds = time.perf_counter() - started
            self._count_load(card.id, "ok", seconds)
            log.info("loaded %s in %.2f s (%d bytes measured)", card.id, seconds, runner.num_bytes)
            return runner
        except Overloaded:
            self._count_load(card.id, "no_room", None)
            raise
        except Exception as exc:
            failure = self._record_failure(self._failures, card.id, f"model {card.id}", exc)
            self._count_load(card.id, "failed", None)
            raise retry_later(failure) from None
        finally:
            del self._loading[card.id]
            self._loading_since.pop(card.id, None)
            self._record()

    def _record_failure(self, store: dict, key: str | tuple[str, str], what: str, exc: Exception) -> Failure:
        """Record a failed load of `what` under `key` in `store`, with its back-off."""
        previous = store.get(key)
        attempts = previous.attempts + 1 if previous else 1
        backoff_s = min(MAX_BACKOFF_S, self._backoff_s * 2 ** (attempts - 1))
        if isinstance(exc, ModelLoadError):
            log.error("loading %s failed (attempt %d; next try in %.1f s): %s", what, attempts, backoff_s, exc.message)
            cause = exc.public_message
        else:
            log.exception("loading %s failed (attempt %d; next try in %.1f s)", what, attempts, backoff_s)
            cause = f"{type(exc).__name__} while loading (the server log has the traceback)"
        # Numbers, and `weights` (whether the load failed for want of them): never the paths tried.
        kept = {k: v for k, v in getattr(exc, "details", {}).items() if isinstance(v, (int, float)) or k == "weights"}
        details = {**kept, "model": key if isinstance(key, str) else key[0], "attempts": attempts}
        if not isinstance(key, str):
            details["adapter"] = key[1]
        permanent = isinstance(exc, ModelLoadError) and exc.permanent
        error = ModelLoadError(f"{what} could not be loaded: {cause}", details=details, permanent=permanent)
        failure = store[key] = Failure(error, attempts, time.monotonic() + backoff_s)
        return failure

    @contextlib.asynccontextmanager
    async def _room(self, subject: str, needed: int, workspace: int = 0, keep: str | None = None):
        """Hold the materialize lock with room made for `needed` more bytes (and `workspace`).
        While only work in flight stands in the way, wait for it to end — outside the lock, so
        the work (or an adapter load it waits on) can finish — up to `load_timeout_s`."""
        give_up_at = time.monotonic() + self._load_timeout_s
        while True:
            async with self._load_lock:
                event = self._released  # a release from now on wakes the wait below
                if self.budget_bytes is None or self._evict_for(subject, needed, workspace, keep):
                    yield
                    return
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                raise Overloaded(
                    f"no room to load {subject}: the models in memory are busy; retry shortly",
                    retry_after_s=2.0,
                    details={
                        "needed_bytes": needed,
                        "resident_bytes": self.loaded_bytes,
                        "memory_budget_bytes": self.budget_bytes,
                    },
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    def _evict_for(self, subject: str, needed: int, workspace: int = 0, keep: str | None = None) -> bool:
        """Evict idle adapters, then idle unpinned models (never `keep`), least recently used first,
        until `needed` more bytes fit beside what is resident (with `workspace` or the largest
        resident one's). True if they fit; False if work in flight is in the way (worth a wait);
        raises if nothing that may ever leave would make room."""
        assert self.budget_bytes is not None
        budget = self.budget_bytes

        def used(models, fixed: bool = False) -> int:
            runners = [self._loaded[m] for m in models]
            held = sum(self._fixed_bytes(m) if fixed else self.model_bytes(m) for m in models)
            return held + self._workspace(runners, workspace)

        staying = [m for m in self._loaded if m == keep]  # what stays whatever happens (less idle adapters)
        if used(staying, fixed=True) + needed > budget:
            raise ModelLoadError(
                f"{subject} needs {needed + workspace} bytes"
                + (f" beside {keep}" if keep else "")
                + f", more than the memory budget of {budget}",
                details={"needed_bytes": needed + workspace, "memory_budget_bytes": budget},
            )
        if used([m for m in self._loaded if m == keep or m in self._pinned], fixed=True) + needed > budget:
            raise Overloaded(
                f"no room to load {subject}: pinned models hold the memory budget; unpin one",
                retry_after_s=2.0,
                details={"needed_bytes": needed, "memory_budget_bytes": budget},
            )

        def fits() -> bool:
            return used(list(self._loaded)) + needed <= budget

        for key in [k for k in self._adapters if self._adapter_inflight[k] == 0]:
            if fits():
                return True
            self._drop_adapter(key, "evicted")
        for victim in list(self._loaded):
            if fits():
                return True
            if victim != keep and victim not in self._pinned and self._inflight[victim] == 0:
                self._evict(victim, "evicted")
        return fits()

    def _evict(self, model_id: str, reason: str) -> None:
        runner = self._loaded.pop(model_id, None)
        if runner is None:
            return
        self._drop_when_idle.pop(model_id, None)
        for key in [k for k in self._adapters if k[0] == model_id]:
            del self._adapters[key]
        for key in [k for k in self._adapter_stale if k[0] == model_id]:
            self._adapter_stale.discard(key)
        runner.close()
        self._notify()
        log.info("unloaded %s (%s)", model_id, reason)
        if self._metrics is not None:
            self._metrics.evictions.labels(model_id, reason).inc()
            with contextlib.suppress(KeyError):  # the gauge had no sample for it yet
                self._metrics.model_bytes.remove(model_id)
        self._record()

    # --- operators ------------------------------------------------------------------------------

    def pin(self, model_id: str) -> None:
        self._pinned.add(model_id)
        if self._drop_when_idle.get(model_id) == "unload":  # pinning cancels an unload still waiting
            del self._drop_when_idle[model_id]

    def unpin(self, model_id: str) -> None:
        self._pinned.discard(model_id)
        self._notify()  # a load waiting for room may now find some

    def unload(self, model_id: str) -> str:
        """Unload now ("unloaded"), after the work in flight ("unloading"), or "not_loaded".
        A pinned model is refused (unpin it first)."""
        if model_id in self._pinned:
            raise InvalidRequest(
                f"model {model_id} is pinned: unpin it first (POST /v1/models/{model_id}/unpin)",
                details={"model": model_id},
            )
        if model_id not in self._loaded:
            return "not_loaded"
        if self._inflight[model_id] > 0:
            self._drop_when_idle[model_id] = "unload"
            return "unloading"
        self._evict(model_id, "unload")
        return "unloaded"

    def invalidate(self, model_id: str) -> None:
        """The model's card changed: drop it once idle (now, if it is), so the next request loads
        the new card; a recorded failure is forgotten."""
        self._failures.pop(model_id, None)
        self._measured.pop(model_id, None)
        self._generation[model_id] += 1  # a load under way of the old card is not kept
        for key in [k for k in self._adapter_failures if k[0] == model_id]:
            del self._adapter_failures[key]
        if model_id in self._loaded and self._inflight[model_id] > 0:
            self._drop_when_idle[model_id] = "changed"  # new requests wait for the old model to drain
        elif model_id in self._loaded:
            self._evict(model_id, "changed")

    def _count_load(self, model_id: str, outcome: str, seconds: float | None) -> None:
        if self._metrics is None:
            return
        self._metrics.loads.labels(model_id, outcome).inc()
        if seconds is not None:
            self._metrics.load_seconds.labels(model_id).observe(seconds)

    def _record(self) -> None:
        m = self._metrics
        if m is None:
            return
        m.loaded_models.set(len(self._loaded))
        m.loaded_bytes.set(self.loaded_bytes)
        m.device_bytes.labels(self._device).set(self.loaded_bytes)
        for model_id in self._loaded:
            m.model_bytes.labels(model_id).set(self.model_bytes(model_id))
        m.adapters_resident.set(len(self._adapters))

    def close(self) -> None:
        for runner in self._loaded.values():
            runner.close()
        self._loaded.clear()
        self._adapters.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
