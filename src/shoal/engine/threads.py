"""Threads for work beside the device's lanes that may run torch (loads, adapters, weight fetches).

Each job runs on a thread of its own that ends with the job, never on a pooled thread that lives on.
The reason is libgomp, the OpenMP runtime torch's CPU wheels use. Every thread that runs a parallel
torch op gets its own team of worker threads, and the team lives as long as that thread. Once the
process holds more OpenMP threads than cores, libgomp's workers stop spin-waiting between
parallel regions (100 spins, against 300,000 otherwise) and sleep on a futex instead. The device
thread's forward then pays a wake-up at every op.

A server whose model had been loaded on a pooled loader thread ran its forwards on well under its
cores; with a thread per load they run on all of them (docs/benchmarks.md, threads). So the
device's lanes keep the only OpenMP teams in the process once a job is done.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class ThreadPerJob(Executor):
    """An executor that starts a new thread for each job, at most `max_workers` at a time, in the
    order they were submitted; a job's thread ends when the job does (taking its OpenMP team
    with it). Like ThreadPoolExecutor's, its threads are not daemons: the interpreter waits for a
    running job at exit."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._waiting: deque[tuple[Future, Callable[..., Any], tuple, dict]] = deque()
        self._running = 0  # jobs started and not yet finished
        self._threads: set[threading.Thread] = set()  # started, perhaps not yet ended (for shutdown)
        self._count = itertools.count()
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._threads = {t for t in self._threads if t.is_alive()}
            self._waiting.append((future, fn, args, kwargs))
            self._start_waiting()
        return future

    def _start_waiting(self) -> None:
        """Start threads for waiting jobs while there is room (the lock held); never raises."""
        while self._waiting and self._running < self._max_workers:
            job = self._waiting.popleft()
            future = job[0]
            if future.cancelled():
                continue
            thread = threading.Thread(target=self._work, args=job, name=f"{self._prefix}_{next(self._count)}")
            try:
                thread.start()
            except BaseException as exc:  # no thread to be had (a process limit, the interpreter exiting)
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
                continue
            self._running += 1
            self._threads.add(thread)

    def _work(self, future: Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            with self._lock:
                self._running -= 1
                self._start_waiting()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            if cancel_futures:
                for future, *_ in self._waiting:
                    future.cancel()
                self._waiting.clear()
        while wait:  # every job run, and every thread ended (its OpenMP team gone with it)
            with self._lock:
                threads = [t for t in self._threads if t.is_alive()]
                if not threads and not self._waiting:
                    return
            for thread in threads:
                thread.join()


# How many device lanes the calling thread is one of (engine/device.py); its forwards take that
# share of a model's intra-op threads (ModelRunner.threads_for).
_lane = threading.local()


def share_threads(lanes: int) -> None:
    """The calling thread is one of `lanes` device lanes running batches side by side."""
    _lane.count = lanes


def lanes_of_this_thread() -> int:
    return getattr(_lane, "count", 1)


def lane_threads(threads: int, lanes: int) -> int:
    """The intra-op threads a lane runs a model's forwards on: its share of `threads`."""
    return max(1, threads // lanes)
