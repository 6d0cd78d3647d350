"""engine/threads.py: each job beside the device thread gets a thread that ends with it, so no
OpenMP team outlives a load (libgomp stops spin-waiting once the process holds more OpenMP threads
than cores, and the device thread's forward then pays a wake-up at every op)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shoal.engine.threads import ThreadPerJob


def native_threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def foreign_threads() -> set[int]:
    """Native threads Python did not start (torch's OpenMP workers among them)."""
    return native_threads() - {t.native_id for t in threading.enumerate()}


def gone_within(tids: set[int], timeout_s: float = 10.0) -> set[int]:
    """The threads of `tids` still alive after up to `timeout_s`."""
    end = time.monotonic() + timeout_s
    while (alive := tids & native_threads()) and time.monotonic() < end:
        time.sleep(0.02)
    return alive


def parallel_torch_job() -> set[int]:
    """A torch op large enough for a two-thread OpenMP region; returns the threads it started."""
    before, threads = foreign_threads(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        for _ in range(3):
            a @ a
    finally:
        torch.set_num_threads(threads)
    return foreign_threads() - before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_no_openmp_worker_outlives_a_job_that_ran_torch_but_a_pooled_thread_keeps_its_team():
    pooled = ThreadPoolExecutor(max_workers=1)
    try:
        started = pooled.submit(parallel_torch_job).result()
        if not started:
            pytest.skip("this torch starts no OpenMP worker thread (not libgomp): nothing to check")
        time.sleep(0.5)
        assert started & native_threads(), "the pooled thread's OpenMP worker is expected to live on"
    finally:
        pooled.shutdown()

    jobs = ThreadPerJob(max_workers=1, thread_name_prefix="test-job")
    started = jobs.submit(parallel_torch_job).result()
    assert started
    assert not gone_within(started), "a thread the job started (its OpenMP team) outlived the job"


def test_each_job_runs_on_a_new_thread_that_ends_with_it_and_results_and_errors_come_back():
    jobs = ThreadPerJob(max_workers=2, thread_name_prefix="test-job")
    threads = [jobs.submit(threading.current_thread).result() for _ in range(3)]
    assert len({id(t) for t in threads}) == 3
    assert all(t.name.startswith("test-job_") for t in threads)
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert jobs.submit(pow, 2, 10).result() == 1024
    with pytest.raises(ZeroDivisionError):
        jobs.submit(lambda: 1 / 0).result()


def test_at_most_max_workers_run_at_once_and_they_start_in_submission_order():
    jobs = ThreadPerJob(max_workers=2, thread_name_prefix="test-job")
    lock = threading.Lock()
    running, most, order = 0, 0, []

    def job(i: int) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            order.append(i)
        time.sleep(0.05)
        with lock:
            running -= 1

    for f in [jobs.submit(job, i) for i in range(6)]:
        f.result()
    assert most == 2
    assert order[:2] in ([0, 1], [1, 0]) and sorted(order) == list(range(6))

    serial = ThreadPerJob(max_workers=1, thread_name_prefix="test-job")
    order.clear()
    for f in [serial.submit(job, i) for i in range(4)]:
        f.result()
    assert order == [0, 1, 2, 3]


def test_a_waiting_job_can_be_cancelled_and_shutdown_cancels_the_rest_then_refuses_new_ones():
    jobs = ThreadPerJob(max_workers=1, thread_name_prefix="test-job")
    release = threading.Event()
    ran: list[str] = []
    first = jobs.submit(lambda: release.wait(5) and ran.append("first"))
    second = jobs.submit(ran.append, "second")
    third = jobs.submit(ran.append, "third")
    assert second.cancel()
    jobs.shutdown(wait=False, cancel_futures=True)
    assert third.cancelled()
    release.set()
    first.result(timeout=5)
    jobs.shutdown(wait=True)
    assert ran == ["first"]
    with pytest.raises(RuntimeError):
        jobs.submit(ran.append, "late")


def test_shutdown_waits_for_every_job_thread_to_end():
    jobs = ThreadPerJob(max_workers=2, thread_name_prefix="test-job")
    futures = [jobs.submit(lambda: time.sleep(0.2) or threading.current_thread()) for _ in range(3)]
    jobs.shutdown(wait=True)
    assert all(f.done() for f in futures)
    assert not any(f.result().is_alive() for f in futures)


def test_a_thread_that_cannot_start_fails_its_job_and_the_next_job_still_runs(monkeypatch):
    """No thread to be had (a process's thread limit): that job errs, the executor goes on."""
    jobs = ThreadPerJob(max_workers=1, thread_name_prefix="test-job")
    start = threading.Thread.start
    tries: list[str] = []

    def start_unless_first(thread: threading.Thread) -> None:
        tries.append(thread.name)
        if len(tries) == 1:
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_unless_first)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        jobs.submit(pow, 2, 3).result(timeout=5)
    assert jobs.submit(pow, 2, 4).result(timeout=5) == 16
    jobs.shutdown(wait=True)
    assert len(tries) == 2
