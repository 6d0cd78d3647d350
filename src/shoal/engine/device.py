"""The device worker: the threads that own a device, fed by the scheduler.

    submit(Pending) ─▶ scheduler (fair, token budget) ─▶ device lanes ─▶ runner.forward ─▶ settle on the loop

- A device runs its batches on `lanes` threads. A GPU has one. A CPU has two by default, each
  running its own batch on its share of torch's intra-op threads: two one-thread forwards side by
  side wait at no OpenMP barrier for a thread the HTTP side preempted, so they run more tokens than
  one two-thread forward on query-sized batches (docs/benchmarks.md, lanes).
  A lane that finds other lanes idle takes only its share of the queued tokens, so a lone request
  of several sequences still runs on every core.
- Two batches of one model run side by side unless one of them routes LoRA adapters: those hooks
  are installed on the model for one forward (layers/lora.py), so such a batch has the model to
  itself (engine/model_turns.py).

- A failed batch is run again one sequence at a time, so only the sequences that fail get an
  error (`InferenceFailed` with the request id; the traceback goes to the log, not the client).
- Requests whose caller went away or whose deadline passed are dropped before compute.
- If a lane itself dies, `ready` turns false; once the other lanes have finished their batches,
  every request still held fails with 503 and new lanes start after `restart_delay_s`.
- `stop` finishes what is queued, then joins the lanes; it reports whether they ended, so the
  caller never frees a model under a running batch.

Idle lanes sleep on a condition variable until work arrives; there is no polling. After each batch
a lane asks the device's heap trim policy (engine/heap_trim.py) whether to give freed memory back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from ..errors import DeadlineExceeded, InferenceFailed, Overloaded
from ..metrics import Metrics
from .backend import LoadedModel
from .heap_trim import HeapTrimmer
from .model_turns import ModelTurns
from .pending import Pending
from .scheduler import BatchLimits, Scheduler, Slot
from .threads import share_threads
from .types import Batch

log = logging.getLogger("shoal.device")

CONTENTION_WINDOW_S = 5.0


class DeviceWorker:
    def __init__(
        self,
        limits_for: Callable[[str], BatchLimits],
        metrics: Metrics,
        *,
        name: str = "shoal-device",
        restart_delay_s: float = 1.0,
        small_request_tokens: int = 1024,
        min_rate_tokens: int = 128,
        lanes: int = 1,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"a device needs at least one lane, not {lanes}")
        self._scheduler: Scheduler[Pending] = Scheduler(limits_for)
        self._metrics = metrics
        self._name = name
        self._restart_delay_s = restart_delay_s
        self._lanes = lanes
        lock = threading.RLock()
        self._wake = threading.Condition(lock)  # work arrived, a lane died, or the device stops
        self._turns = ModelTurns(lock)  # which lanes may run a batch on a model now
        self._threads: list[threading.Thread] = []
        self._alive = 0  # lanes not yet ended (the lock held)
        self._running = 0  # lanes inside a batch (the lock held)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._dead = False
        self._live: dict[int, Pending] = {}  # submitted and not yet released (the loop's side)
        # While a large request is live and a small one (at most `small_request_tokens`) arrived in
        # the last CONTENTION_WINDOW_S, batches are kept short: small ones never wait on a long batch.
        self._small_request_tokens = small_request_tokens
        self._small_seen_at = -1e9
        self._large_live = 0  # large requests submitted and not yet released (the loop's side)
        self._heap = HeapTrimmer()
        self._tokens_per_s: float | None = None
        self._model_rates: dict[str, float] = {}  # tokens/s per model, from batches of min_rate_tokens+
        # The same times the lanes busy beside each batch: what the whole device does for the model.
        self._model_device_rates: dict[str, float] = {}
        self._min_rate_tokens = min_rate_tokens

    # --- the event loop's side ------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._spawn()

    def _spawn(self) -> None:
        self._dead = False
        self._alive = self._lanes
        self._running = 0
        self._turns.clear()
        self._threads = [
            threading.Thread(
                target=self._lane_main, daemon=True, name=self._name if self._lanes == 1 else f"{self._name}-{i}"
            )
            for i in range(self._lanes)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def lanes(self) -> int:
        return self._lanes

    @property
    def ready(self) -> bool:
        return (
            bool(self._threads) and all(t.is_alive() for t in self._threads) and not self._dead and not self._stopping
        )

    @property
    def tokens_per_s(self) -> float | None:
        return self._tokens_per_s

    @property
    def contended(self) -> bool:
        """Whether a large request is on the device while small ones keep arriving: then batches are
        cut by time (bulk work alone, or small requests alone, keep full batches)."""
        return self._large_live > 0 and time.monotonic() - self._small_seen_at < CONTENTION_WINDOW_S

    def tokens_per_s_of(self, model_id: str) -> float | None:
        """The model's measured token rate on one lane (batches too small to say are left out)."""
        return self._model_rates.get(model_id)

    def device_tokens_per_s_of(self, model_id: str) -> float | None:
        """The model's measured token rate on the whole device: each batch's rate times the lanes
        that were busy beside it. Lanes share the cores, so one lane's rate alone times the number
        of lanes would count cores twice; a model measured only alone counts one lane (cautious)."""
        return self._model_device_rates.get(model_id)

    def submit(self, pending: Pending) -> None:
        """Queue `pending`; from here on the device settles and releases it (raises if it cannot)."""
        with self._wake:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", retry_after_s=1.0)
            if self._dead or not self._threads:
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
        """Finish the queued work and end the lanes; True when they ended within `timeout_s`."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            await asyncio.to_thread(thread.join, max(0.0, end - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            log.error("a device thread is still running a batch after %.0f s", timeout_s)
            return False
        return True

    def _died(self) -> None:
        """On the loop, once every lane has ended after one died: fail what they held with 503, and
        start new lanes after a pause."""
        self._dead = True
        with self._wake:
            self._scheduler.drain()
        error = Overloaded(
            "the device worker failed and is restarting; retry shortly", retry_after_s=self._restart_delay_s
        )
        for pending in list(self._live.values()):
            pending.error = pending.error or error
            self._settle(pending)
            self._release(pending)
        if not self._stopping and self._loop is not None:
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

    def _lane_main(self) -> None:
        share_threads(self._lanes)  # this thread's forwards take 1/lanes of a model's threads
        try:
            self._serve()
        except BaseException:
            log.exception("a device thread died")
            with self._wake:
                self._dead = True  # the other lanes end after their batches
                self._wake.notify_all()
        finally:
            with self._wake:
                self._alive -= 1
                last = self._alive == 0
            if last and self._dead:
                self._call_soon(self._died)

    def _serve(self) -> None:
        """Run batches until stopped; on stop, finish what was already queued (none is dropped)."""
        while True:
            with self._wake:
                while True:
                    if self._dead:  # another lane died: the loop fails what is left once all have ended
                        return
                    batch, dropped = self._take()
                    if batch or dropped or self._stopping:
                        break
                    self._wake.wait()
                    if self._running == 0:  # a lane woken for another's rest takes it at once
                        self._linger()
            if dropped:
                self._drop(dropped)
            if batch:
                try:
                    self._run(batch)
                finally:
                    with self._wake:
                        self._running -= 1
                self._trim_if_idle()
            elif self._stopping and not dropped:
                return

    def _take(self) -> tuple[list[Slot[Pending]], list[Pending]]:
        """(this lane's next batch, the requests dropped on the way), the lock held. With other lanes
        idle, the batch takes only its share of the queued tokens, and an idle lane is woken for the
        rest: a lone request of several sequences runs on every lane."""
        idle = self._lanes - self._running
        queued = self._scheduler.num_tokens
        share = -(-queued // idle) if idle > 1 and queued else None
        batch, dropped = self._scheduler.next_batch(time.monotonic(), share)
        for pending in dropped:
            pending.dropped = True
        for pending in {id(p): p for p, _ in batch}.values():
            pending.in_batches += 1
        if batch:
            self._running += 1
            if len(self._scheduler) and self._running < self._lanes:
                self._wake.notify()
        return batch, dropped

    def _linger(self) -> None:
        """Woken from idle (the lock held): if the next model's limits ask for a batching wait, wait
        up to that long for more of its work, until a full batch is queued or the device stops."""
        model_id = self._scheduler.next_model()
        if model_id is None:
            return
        limits = self._scheduler.limits_of(model_id)
        end = time.monotonic() + limits.batch_wait_s
        while (
            not self._stopping
            and self._scheduler.num_tokens < limits.max_batch_tokens
            and len(self._scheduler) < limits.max_batch_items
        ):
            left = end - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(left)

    def _trim_if_idle(self) -> None:
        """Give freed memory back to the OS when the heap trim policy says so (engine/heap_trim.py)."""
        now = time.monotonic()
        with self._wake:  # lanes call this after each batch: one of them looks
            self._heap.after_batch(now, idle=len(self._scheduler) == 0 and self._running == 0)

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
            with self._wake:  # a lane still running some of its sequences releases it when done
                free = pending.in_batches == 0
            if free:
                self._call_soon(self._release, pending)

    def _run(self, slots: list[Slot[Pending]]) -> None:
        runner = slots[0][0].runner
        if any(p.adapter_slot >= 0 for p, _ in slots):
            # Each adapter's sequences side by side (the base's first): its LoRA delta is then one
            # slice of the batch's tokens, not a gather and scatter (layers/lora.py).
            slots = sorted(slots, key=lambda slot: slot[0].adapter_slot)
        alone = any(p.adapter_slot >= 0 for p, _ in slots)
        self._turns.enter(runner, alone)
        side_by_side = self._running  # lanes in a batch now, this one included
        started = time.perf_counter()
        try:
            outputs: list[object] = self._forward(runner, slots)
        except Exception:  # retried one sequence at a time: only the failing ones err
            outputs = []
            for slot in slots:
                try:
                    outputs.extend(self._forward(runner, [slot]))
                except Exception as exc:
                    outputs.append(exc)
        finally:
            self._turns.leave(runner, alone)
        elapsed = time.perf_counter() - started
        model_id = slots[0][0].model_id
        num_tokens = sum(p.lengths[i] for p, i in slots)
        m = self._metrics  # recorded before answering, so a caller's next scrape already counts it
        m.batch_tokens.labels(model_id).observe(num_tokens)
        m.batch_items.labels(model_id).observe(len(slots))
        m.tokens.labels(model_id).inc(num_tokens)
        m.items.labels(model_id).inc(len(slots))
        if elapsed > 0:
            rate = num_tokens / elapsed  # one lane's: how long a batch of the model takes
            device_rate = rate * max(1, side_by_side)  # the device's, with the lanes busy beside it
            self._tokens_per_s = (
                device_rate if self._tokens_per_s is None else 0.8 * self._tokens_per_s + 0.2 * device_rate
            )
            if num_tokens >= self._min_rate_tokens:
                old = self._model_rates.get(model_id)
                self._model_rates[model_id] = rate if old is None else 0.7 * old + 0.3 * rate
                old = self._model_device_rates.get(model_id)
                self._model_device_rates[model_id] = device_rate if old is None else 0.7 * old + 0.3 * device_rate
        for (pending, index), output in zip(slots, outputs):
            if isinstance(output, Exception):
                log.error("request %s: inference failed on item %d", pending.request_id, index, exc_info=output)
                m.failed_items.labels(model_id).inc()
        in_batch: dict[int, Pending] = {}
        with self._wake:  # other lanes may hold batches of the same requests
            for (pending, index), output in zip(slots, outputs):
                if id(pending) not in in_batch:
                    pending.ran(started, started + elapsed)
                    in_batch[id(pending)] = pending
                if isinstance(output, Exception) and pending.error is None:
                    pending.error = InferenceFailed(
                        f"inference failed on items[{index}] (request id {pending.request_id}); "
                        "the server log has the details",
                        details={"request_id": pending.request_id, "index": index},
                    )
                pending.outputs[index] = output
                pending.remaining -= 1
            finished = time.perf_counter()
            for pending in in_batch.values():
                pending.in_batches -= 1
                if pending.remaining == 0 or pending.error is not None:
                    pending.finished_at = finished
                    self._call_soon(self._settle, pending)
                # Released once no lane will touch it again: every sequence ran, or the scheduler
                # dropped the rest while this batch ran (then `_drop` left the release to it).
                if pending.in_batches == 0 and (pending.remaining == 0 or pending.dropped):
                    self._call_soon(self._release, pending)

    @staticmethod
    def _forward(runner: LoadedModel, slots: list[Slot[Pending]]) -> list[object]:
        batch = Batch.pack([p.seqs[i] for p, i in slots], [p.adapter_slot for p, _ in slots])
        outputs = runner.forward(batch, [p.specs[i] for p, i in slots])
        if len(outputs) != len(slots):
            raise RuntimeError(f"the backend returned {len(outputs)} outputs for {len(slots)} sequences")
        return outputs

    def _call_soon(self, fn, *args) -> None:
        assert self._loop is not None, "the device was started on a loop"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
