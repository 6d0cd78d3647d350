"""Overload and abuse, against a real server on loopback (issue 33): a huge `/tokenize` neither
stalls the server nor costs more than the tokens it keeps, and admission bounds the time admitted
work takes, telling the refused when to come back (engine/admission.py)."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest

from conftest import MODEL_ID
from shoal.config import EngineSettings
from shoal.engine.admission import Admission
from shoal.errors import InvalidRequest, Overloaded

# About 7 MB of words (the default body limit is 8 MiB).
BOUND_S = 3.0
HUGE_TEXT = "the quick brown fox jumps over the lazy dog and keeps on running " * 110_000


def _probe(url: str, stop: threading.Event, waits: list[float]) -> None:
    """/healthz every 50 ms until `stop`, recording how long each answer took."""
    with httpx.Client(base_url=url, timeout=30.0) as http:
        while not stop.is_set():
            started = time.perf_counter()
            assert http.get("/healthz").status_code == 200
            waits.append(time.perf_counter() - started)
            time.sleep(0.05)


@pytest.fixture(scope="module")
def timed_url(serve) -> str:
    """A server with the default body limit (8 MiB) whose admission bound is BOUND_S."""
    return serve(engine=EngineSettings(max_queue_s=BOUND_S))


def test_huge_tokenize_requests_leave_liveness_within_a_second_and_answer_the_cut_tokens(timed_url):
    base_url = timed_url
    answers: list[httpx.Response] = []

    def attack() -> None:
        with httpx.Client(base_url=base_url, timeout=120.0) as http:
            for _ in range(3):
                answers.append(http.post("/tokenize", json={"inputs": HUGE_TEXT}))

    stop, waits = threading.Event(), []
    prober = threading.Thread(target=_probe, args=(base_url, stop, waits))
    prober.start()
    attackers = [threading.Thread(target=attack) for _ in range(4)]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join()
    stop.set()
    prober.join()

    assert waits and max(waits) < 1.0, f"/healthz took up to {max(waits):.2f} s under the attack"
    short = httpx.post(f"{base_url}/tokenize", json={"inputs": HUGE_TEXT[:4000]}, timeout=30).json()[0]
    assert len(short) == 256  # MiniLM's max_length: the cut keeps exactly what the whole text would
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json() == [short]


@pytest.fixture(scope="module")
def small_queue_url(serve) -> str:
    return serve(engine=EngineSettings(max_queue_items=4))


def test_tokenize_goes_through_admission(small_queue_url):
    refused = httpx.post(f"{small_queue_url}/tokenize", json={"inputs": [f"text {i}" for i in range(5)]}, timeout=30)
    assert refused.status_code == 400 and "more than the queue holds" in refused.json()["error"]["message"]
    assert httpx.post(f"{small_queue_url}/tokenize", json={"inputs": ["one", "two"]}, timeout=30).status_code == 200


# --- admission by time ----------------------------------------------------------------------------

PASSAGE = "Admission is by the time the backlog takes at the measured rate, not by its tokens alone. " * 4


def test_a_burst_is_admitted_only_as_far_as_it_finishes_within_the_bound_and_retry_after_then_holds(timed_url):
    body = {"model": MODEL_ID, "items": [{"text": f"{i} {PASSAGE}"} for i in range(16)]}
    with httpx.Client(base_url=timed_url, timeout=120.0) as http:
        for _ in range(3):  # the device's rate for this model is measured
            assert http.post("/v1/encode", json=body).status_code == 200
    outcomes: list[tuple[int, float, float | None]] = []  # status, seconds, Retry-After
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=timed_url, timeout=120.0) as http:
            for _ in range(8):
                started = time.perf_counter()
                answer = http.post("/v1/encode", json=body)
                retry = answer.headers.get("retry-after")
                with lock:
                    outcomes.append((answer.status_code, time.perf_counter() - started, retry and float(retry)))

    clients = [threading.Thread(target=client) for _ in range(32)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()

    admitted = [seconds for status, seconds, _ in outcomes if status == 200]
    refused = [(seconds, retry) for status, seconds, retry in outcomes if status == 503]
    assert len(admitted) + len(refused) == len(outcomes), {status for status, _, _ in outcomes}
    assert admitted and refused, (len(admitted), len(refused))
    # Admitted work finishes within the bound (the rate is an estimate: some slack on a shared machine).
    assert max(admitted) < 2 * BOUND_S, sorted(admitted)[-5:]
    assert all(seconds < 1.0 for seconds, _ in refused)  # refused at once, not after waiting
    assert all(retry is not None and 1 <= retry <= 2 * BOUND_S for _, retry in refused)
    # The burst is over: after the longest Retry-After told, a request is admitted.
    time.sleep(max(retry for _, retry in refused if retry is not None))
    assert httpx.post(f"{timed_url}/v1/encode", json=body, timeout=60).status_code == 200


def _admission(rate: float | None = 100.0, max_seconds: float | None = 10.0) -> Admission:
    return Admission(8192, 1_000_000, max_seconds, lambda model_id: rate)


def test_admission_refuses_what_would_not_finish_within_the_bound_and_says_when_it_would():
    admission = _admission()
    admission.admit("m", 1, 800, 300.0)  # 8 s of work
    admission.admit("m", 1, 200, 300.0)  # 10 s: just within
    with pytest.raises(Overloaded) as info:
        admission.admit("m", 1, 100, 300.0)
    assert info.value.retry_after_s == 1.0 and info.value.details["backlog_s"] == 10.0
    admission.remove("m", 1, 800)  # 8 s have run
    admission.admit("m", 1, 100, 300.0)
    assert math.isclose(admission.backlog_s(), 3.0)


def test_admission_takes_the_calls_timeout_when_shorter_and_refuses_at_once_what_cannot_finish_alone():
    admission = _admission()
    admission.admit("m", 1, 300, 300.0)  # 3 s
    with pytest.raises(Overloaded) as info:
        admission.admit("m", 1, 100, 2.0)  # a 2 s timeout behind 3 s of work
    assert info.value.details["max_queue_s"] == 2.0
    with pytest.raises(InvalidRequest, match="longer timeout_s"):
        admission.admit("m", 1, 500, 2.0)  # 5 s of its own: hopeless even alone


def test_a_request_longer_than_the_bound_waits_behind_a_quarter_of_it_at_most():
    admission = _admission()
    admission.admit("long", 1, 1500, 300.0)  # 15 s alone, with nothing ahead: admitted
    with pytest.raises(Overloaded) as info:
        admission.admit("long", 1, 1500, 300.0)
    assert info.value.retry_after_s == math.ceil(15.0 - 2.5)
    admission.remove("long", 1, 1400)
    admission.admit("long", 1, 1500, 300.0)  # 1 s ahead of it, under a quarter of 10 s


def test_each_model_counts_at_its_own_rate_and_without_a_rate_only_tokens_count():
    rates = {"fast": 1000.0, "slow": 10.0}
    admission = Admission(8192, 1_000_000, 10.0, rates.get)
    admission.admit("fast", 1, 5000, 300.0)  # 5 s
    admission.admit("slow", 1, 40, 300.0)  # 4 s
    assert math.isclose(admission.backlog_s(), 9.0)
    with pytest.raises(Overloaded):
        admission.admit("slow", 1, 20, 300.0)
    admission.admit("new", 1, 100_000, 300.0)  # no rate yet: tokens only
    assert admission.tokens == 105_040
