"""The device worker: the one thread that owns a device, fed by the scheduler.

    submit(Pending) ─▶ scheduler (fair, token budget) ─▶ device thread ─▶ runner.forward ─▶ settle on the loop

- A failed batch is run again one sequence at a time, so only the sequences that fail get an
  error (`InferenceFailed` with the request id; the traceback goes to the log, not the client).
- Requests whose caller went away or whose deadline passed are dropped before compute.
- If the thread itself dies, every request it held fails with 503, `ready` turns false, and a new
  thread starts after `restart_delay_s`.
- `stop` finishes what is queued, then joins the thread; it reports whether the thread ended, so
  the caller never frees a model under a running batch.

The thread sleeps on a condition variable until work arrives; there is no polling.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import DeadlineExceeded, InferenceFailed, Overloaded, ShoalError
from ..metrics import Metrics
from . import memory
from .scheduler import BatchLimits, Scheduler, Slot
from .types import Batch

log = logging.getLogger("shoal.device")

TRIM_EVERY_S = 2.0  # malloc_trim when the device goes idle, at most this often
CONTENTION_WINDOW_S = 5.0


class Pending:
    """One request's sequences on their way through the device, resolved on the event loop."""

    def __init__(self, model_id: str, runner: Any, seqs: Sequence, specs: Sequence, *, deadline: float,
                 request_id: str | None, future: asyncio.Future,
                 on_released: Callable[[], None] | None = None, adapter_slot: int = -1) -> None:
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
        self.outputs: list[Any] = [None] * len(seqs)
        self.remaining = len(seqs)  # written by the device thread only
        self.error: ShoalError | None = None
        self.enqueued_at = time.perf_counter()
        self.inference_s = 0.0
        self.finished_at: float | None = None

    @property
    def cancelled(self) -> bool:
        return self.future.done() or self.error is not None

    @property
    def queue_s(self) -> float:
        end = self.finished_at or time.perf_counter()
        return max(0.0, end - self.enqueued_at - self.inference_s)


class DeviceWorker:
    def __init__(self, limits_for: Callable[[str], BatchLimits], metrics: Metrics, *, name: str = "shoal-device",
                 restart_delay_s: float = 1.0, small_request_tokens: int = 1024, min_rate_tokens: int = 128) -> None:
        self._scheduler = Scheduler(limits_for)
        self._metrics = metrics
        self._name = name
        self._restart_delay_s = restart_delay_s
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._dead = False
        self._live: dict[int, Pending] = {}  # submitted and not yet released (the loop's side)
        # While a large request is live and a small one (at most `small_request_tokens`) arrived in
        # the last CONTENTION_WINDOW_S, batches are kept short: small ones never wait on a long batch.
        self._small_request_tokens = small_request_tokens
        self._small_seen_at = -1e9
        self._large_live = 0  # large requests submitted and not yet released (the loop's side)
        self._trimmed_at = 0.0
        self._rss_after_trim = 0  # the first batch's check trims once and sets it
        self._tokens_per_s: float | None = None
        self._model_rates: dict[str, float] = {}  # tokens/s per model, from batches of min_rate_tokens+
        self._min_rate_tokens = min_rate_tokens

    # --- the event loop's side ------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._spawn()

    def _spawn(self) -> None:
        self._dead = False
        self._thread = threading.Thread(target=self._thread_main, name=self._name, daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._dead and not self._stopping

    @property
    def tokens_per_s(self) -> float | None:
        return self._tokens_per_s

    @property
    def contended(self) -> bool:
        """Whether a large request is on the device while small ones keep arriving: then batches are
        cut by time (bulk work alone, or small requests alone, keep full batches)."""
        return self._large_live > 0 and time.monotonic() - self._small_seen_at < CONTENTION_WINDOW_S

    def tokens_per_s_of(self, model_id: str) -> float | None:
        """The model's measured token rate (batches too small to say are left out)."""
        return self._model_rates.get(model_id)

    def submit(self, pending: Pending) -> None:
        """Queue `pending`; from here on the device settles and releases it (raises if it cannot)."""
        with self._wake:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", retry_after_s=1.0)
            if self._dead or self._thread is None:
                raise Overloaded("the device worker is restarting; retry shortly", retry_after_s=self._restart_delay_s)
            self._live[id(pending)] = pending
            pending.large = sum(pending.lengths) > self._small_request_tokens
            if pending.large:
                self._large_live += 1
            else:
                self._small_seen_at = time.monotonic()
            if not pending.lengths:  # nothing to run
                self._settle(pending)
                self._release(pending)
                return
            self._scheduler.add(pending)
            self._wake.notify()

    def wake(self) -> None:
        """Let the thread look again (a caller went away: its work can be dropped now)."""
        with self._wake:
            self._wake.notify()

    async def stop(self, timeout_s: float) -> bool:
        """Finish the queued work and end the thread; True when it ended within `timeout_s`."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        thread = self._thread
        if thread is None:
            return True
        await asyncio.to_thread(thread.join, timeout_s)
        if thread.is_alive():
            log.error("the device thread is still running a batch after %.0f s", timeout_s)
            return False
        return True

    def _died(self) -> None:
        """On the loop: the thread died. Fail what it held with 503, restart it after a pause."""
        self._dead = True
        with self._wake:
            self._scheduler.drain()
        error = Overloaded("the device worker failed and is restarting; retry shortly",
                           retry_after_s=self._restart_delay_s)
        for pending in list(self._live.values()):
            pending.error = pending.error or error
            self._settle(pending)
            self._release(pending)
        if not self._stopping:
            self._loop.call_later(self._restart_delay_s, self._restart)

    def _settle(self, pending: Pending) -> None:
        """On the loop: answer the request's future (if its caller still waits)."""
        if pending.future.done():
            return
        if pending.error is not None:
            pending.future.set_exception(pending.error)
        else:
            pending.future.set_result(pending.outputs)

    def _release(self, pending: Pending) -> None:
        """On the loop: the device is done with `pending`; its model may be evicted now."""
        self._live.pop(id(pending), None)
        if not pending.released:
            pending.released = True
            self._large_live -= pending.large
            if pending.on_released is not None:
                pending.on_released()

    def _restart(self) -> None:
        if self._stopping:
            return
        log.warning("restarting the device thread")
        self._metrics.device_restarts.inc()
        self._spawn()

    # --- the device thread ----------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            self._serve()
        except BaseException:
            log.exception("the device thread died")
            self._call_soon(self._died)

    def _serve(self) -> None:
        """Run batches until stopped; on stop, finish what was already queued (none is dropped)."""
        while True:
            with self._wake:
                batch, dropped = self._scheduler.next_batch(time.monotonic())
                while not batch and not dropped and not self._stopping:
                    self._wake.wait()
                    self._linger()
                    batch, dropped = self._scheduler.next_batch(time.monotonic())
            if dropped:
                self._drop(dropped)
            if batch:
                self._run(batch)
                self._trim_if_idle()
            elif self._stopping and not dropped:
                return

    def _linger(self) -> None:
        """Woken from idle (the lock held): if the next model's limits ask for a batching wait, wait
        up to that long for more of its work, until a full batch is queued or the device stops."""
        model_id = self._scheduler.next_model()
        if model_id is None:
            return
        limits = self._scheduler.limits_of(model_id)
        end = time.monotonic() + limits.batch_wait_s
        while (not self._stopping and self._scheduler.num_tokens < limits.max_batch_tokens
               and len(self._scheduler) < limits.max_batch_items):
            left = end - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(left)

    def _trim_if_idle(self) -> None:
        """Give freed memory back to the OS when nothing waits (at most every TRIM_EVERY_S), or,
        while busy, once RSS has grown RETAINED_HEAP_BYTES since the last trim: below that, the next
        batches reuse the freed heap without page faults."""
        now = time.monotonic()
        rss = memory.rss_bytes()
        idle = len(self._scheduler) == 0 and now - self._trimmed_at >= TRIM_EVERY_S
        grown = rss is not None and rss > self._rss_after_trim + memory.RETAINED_HEAP_BYTES
        if idle or grown:
            self._trimmed_at = now
            memory.trim()
            self._rss_after_trim = memory.rss_bytes() or 0

    def _drop(self, requests: list[Pending]) -> None:
        now = time.monotonic()
        for pending in requests:
            left = len(pending.lengths) - pending.next_index
            if pending.error is None and pending.future.done():
                self._metrics.dropped_items.labels(pending.model_id, "cancelled").inc(left)
            elif pending.error is None and pending.deadline <= now:
                self._metrics.dropped_items.labels(pending.model_id, "deadline").inc(left)
                pending.error = DeadlineExceeded(
                    "the request's deadline passed while it waited in the queue (phase: queue); "
                    "send fewer items per request or a longer timeout_s",
                    details={"phase": "queue", "request_id": pending.request_id},
                )
                self._call_soon(self._settle, pending)
            self._call_soon(self._release, pending)

    def _run(self, slots: list[Slot]) -> None:
        runner = slots[0][0].runner
        if any(p.adapter_slot >= 0 for p, _ in slots):
            # Each adapter's sequences side by side (the base's first): its LoRA delta is then one
            # slice of the batch's tokens, not a gather and scatter (layers/lora.py).
            slots = sorted(slots, key=lambda slot: slot[0].adapter_slot)
        started = time.perf_counter()
        try:
            outputs: list[Any] = self._forward(runner, slots)
        except Exception:  # retried one sequence at a time: only the failing ones err
            outputs = []
            for slot in slots:
                try:
                    outputs.extend(self._forward(runner, [slot]))
                except Exception as exc:
                    outputs.append(exc)
        elapsed = time.perf_counter() - started
        model_id = slots[0][0].model_id
        num_tokens = sum(p.lengths[i] for p, i in slots)
        m = self._metrics  # recorded before answering, so a caller's next scrape already counts it
        m.batch_tokens.labels(model_id).observe(num_tokens)
        m.batch_items.labels(model_id).observe(len(slots))
        m.tokens.labels(model_id).inc(num_tokens)
        m.items.labels(model_id).inc(len(slots))
        if elapsed > 0:
            rate = num_tokens / elapsed
            self._tokens_per_s = rate if self._tokens_per_s is None else 0.8 * self._tokens_per_s + 0.2 * rate
            if num_tokens >= self._min_rate_tokens:
                old = self._model_rates.get(model_id)
                self._model_rates[model_id] = rate if old is None else 0.7 * old + 0.3 * rate
        in_batch: dict[int, Pending] = {}
        for (pending, index), output in zip(slots, outputs):
            if id(pending) not in in_batch:
                pending.inference_s += elapsed
                in_batch[id(pending)] = pending
            if isinstance(output, Exception):
                log.error("request %s: inference failed on item %d", pending.request_id, index, exc_info=output)
                m.failed_items.labels(model_id).inc()
                if pending.error is None:
                    pending.error = InferenceFailed(
                        f"inference failed on items[{index}] (request id {pending.request_id}); "
                        "the server log has the details",
                        details={"request_id": pending.request_id, "index": index},
                    )
            pending.outputs[index] = output
            pending.remaining -= 1
        finished = time.perf_counter()
        for pending in in_batch.values():
            if pending.remaining == 0 or pending.error is not None:
                pending.finished_at = finished
                self._call_soon(self._settle, pending)
            if pending.remaining == 0:  # every sequence ran: the scheduler holds it no more
                self._call_soon(self._release, pending)

    @staticmethod
    def _forward(runner: Any, slots: list[Slot]) -> list[Any]:
        batch = Batch.pack([p.seqs[i] for p, i in slots], [p.adapter_slot for p, _ in slots])
        outputs = runner.forward(batch, [p.specs[i] for p, i in slots])
        if len(outputs) != len(slots):
            raise RuntimeError(f"the backend returned {len(outputs)} outputs for {len(slots)} sequences")
        return outputs

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

