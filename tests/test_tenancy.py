"""No request can hurt another: cancellation, deadlines, admission by tokens, failure isolation, a
dead device thread, bounded results — over real HTTP (uvicorn on loopback) on the real MiniLM
weights, with sentence-transformers as the reference for every vector that comes back.

The served model is wrapped (`Instrumented`) so a test can hold the device (a text containing
"zebra" makes its batch sleep) or make a batch fail (a text containing "poison" raises inside the
forward, with a message that must never reach the client).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from conftest import MODEL_ID, metric_total

SLOW_WORD, POISON_WORD = "zebra", "poison"
SECRET = "secret internal detail 0xdeadbeef"
SLOW_S = 1.0


class Instrumented:
    """A real ModelRunner that records each batch, sleeps on SLOW_WORD and fails on POISON_WORD."""

    order: list[tuple[str, int]] = []  # (model, sequences) of every batch of every wrapped model

    def __init__(self, runner) -> None:
        self._runner = runner
        self.batches: list[tuple[int, bool]] = []  # (sequences, contained poison)
        self._slow_id = runner.tokenizer.token_id(SLOW_WORD)
        self._poison_id = runner.tokenizer.token_id(POISON_WORD)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def forward(self, batch, specs):
        poisoned = bool((batch.input_ids == self._poison_id).any())
        self.batches.append((batch.num_seqs, poisoned))
        Instrumented.order.append((self._runner.card.id, batch.num_seqs))
        if (batch.input_ids == self._slow_id).any():
            time.sleep(SLOW_S)
        if poisoned:
            raise RuntimeError(SECRET)
        return self._runner.forward(batch, specs)


def body(texts, **options) -> dict:
    return {"model": MODEL_ID, "items": [{"id": i, "text": t} for i, t in enumerate(texts)], "options": options}


def metric(url: str, name: str, **labels) -> float:
    return metric_total(f"{url}/metrics", name, **labels)


def in_background(fn, *args, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


def hold_device(url: str, results: list, lanes: int = 1) -> threading.Thread:
    """A request per device lane whose batch sleeps SLOW_S; returns once they are on the device."""

    def send(i: int):
        results.append(
            httpx.post(f"{url}/v1/encode", json=body([f"a {SLOW_WORD} holds lane {i}"], timeout_s=60), timeout=60)
        )

    threads = [in_background(send, i) for i in range(lanes)]
    time.sleep(0.3)  # tokenized and running by now
    return SimpleNamespace(join=lambda timeout: [t.join(timeout) for t in threads])


@pytest.fixture(scope="module", params=[1, 2], ids=["one-lane", "two-lanes"])
def wrapped(serve, request):
    from shoal.config import EngineSettings

    runners: list[Instrumented] = []

    def wrap(runner):
        runners.append(Instrumented(runner))
        return runners[-1]

    url = serve(engine=EngineSettings(device_restart_delay_s=1.5, device_lanes=request.param), wrap_runner=wrap)
    return url, runners[0], serve.engines[url]


@pytest.fixture(scope="module")
def strict(serve):
    """A server with a short default deadline, a small token queue and a small result limit (and no
    bound on admitted time: the runner's sleeps make its measured rate meaningless)."""
    from shoal.config import EngineSettings

    url = serve(
        engine=EngineSettings(
            request_timeout_s=0.5, max_queue_tokens=1000, max_result_bytes=100_000, device_lanes=1, max_queue_s=None
        ),
        wrap_runner=Instrumented,
    )
    return url


def cosine_ok(items, reference_model, texts) -> bool:
    expected = reference_model.encode(texts)
    got = np.asarray([item["dense"] for item in items])
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    return bool(cos.min() >= 0.99999)


# --- cancellation -------------------------------------------------------------------------------


def test_an_abandoned_bulk_request_is_dropped_and_a_request_after_it_is_answered_within_a_few_batches(wrapped):
    url, runner, _ = wrapped
    docs = [
        f"document {i}: shoals of small fish swim together in the warm shallow water near the reef" for i in range(2048)
    ]
    items_before = metric(url, "shoal_items_total", model=MODEL_ID)
    dropped_before = metric(url, "shoal_dropped_items_total", model=MODEL_ID, reason="cancelled")
    abandoned_before = metric(url, "shoal_requests_total", route="encode", status="499")

    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{url}/v1/encode", json=body(docs), timeout=httpx.Timeout(60, read=1.5))
    started = time.perf_counter()
    small = httpx.post(f"{url}/v1/encode", json=body(["one small request"]), timeout=60)
    waited_s = time.perf_counter() - started

    assert small.status_code == 200, small.text
    # Another lane may still be finishing a batch of the bulk taken before it was abandoned: every
    # item is counted once it ran or was dropped.
    deadline = time.monotonic() + 5
    while True:
        ran = metric(url, "shoal_items_total", model=MODEL_ID) - items_before
        dropped = metric(url, "shoal_dropped_items_total", model=MODEL_ID, reason="cancelled") - dropped_before
        if ran + dropped >= 2048 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ran < 1024, f"{ran} items of the abandoned request still ran"  # most of it never reached the device
    assert dropped >= 2048 - ran  # and /metrics says so
    # The bulk had seconds of work left (41k tokens; it was abandoned after 1.5 s); the small
    # request waited for the batch in progress, at most, plus its own.
    assert waited_s < 3.0, waited_s
    deadline = time.monotonic() + 5
    while metric(url, "shoal_requests_total", route="encode", status="499") == abandoned_before:
        assert time.monotonic() < deadline, "the abandoned request was not recorded as 499"
        time.sleep(0.05)


# --- fairness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("small_model", [MODEL_ID, "rasyosef/splade-tiny"], ids=["same-model", "other-model"])
def test_a_small_request_waits_at_most_one_bulk_batch_on_the_same_or_another_model(wrapped, small_model):
    url, _, engine = wrapped
    httpx.post(f"{url}/v1/encode", json={"model": small_model, "items": [{"text": "warm"}]}, timeout=60)  # loaded
    docs = [f"bulk document {i} about the migration of fish along the coast in spring" for i in range(1024)]
    bulk = in_background(lambda: httpx.post(f"{url}/v1/encode", json=body(docs, timeout_s=120), timeout=120))
    time.sleep(0.5)  # the bulk is tokenized and running
    start = len(Instrumented.order)
    small = httpx.post(
        f"{url}/v1/encode", json={"model": small_model, "items": [{"text": "a small query"}]}, timeout=60
    )
    answered = len(Instrumented.order)
    bulk.join(120)

    assert small.status_code == 200, small.text
    after = Instrumented.order[start:]
    assert sum(n for m, n in after if m == MODEL_ID) > 256  # the bulk still had batches to run after it
    # Batches started from the small request's arrival to its answer: on each lane at most the one
    # after the batch running there, then the small request's own.
    lanes = engine.device_lanes
    assert answered - start <= 1 + 2 * lanes, (lanes, after[: answered - start])


# --- deadlines ----------------------------------------------------------------------------------


def test_a_request_whose_deadline_passes_in_the_queue_gets_504_naming_the_phase_and_is_never_run(wrapped):
    url, runner, engine = wrapped
    held: list = []
    thread = hold_device(url, held, engine.device_lanes)
    seen = len(runner.batches)
    late = httpx.post(f"{url}/v1/encode", json=body(["too late", "also too late"], timeout_s=0.2), timeout=30)
    thread.join(30)

    assert late.status_code == 504, late.text
    error = late.json()["error"]
    assert error["code"] == "deadline_exceeded"
    assert error["details"]["phase"] == "queue" and "queue" in error["message"]
    assert error["details"]["request_id"] == late.headers["x-request-id"]
    assert [h.status_code for h in held] == [200] * engine.device_lanes
    assert all(n != 2 for n, _ in runner.batches[seen:])  # its two texts never made a batch
    assert metric(url, "shoal_deadline_exceeded_total", model=MODEL_ID, phase="queue") >= 1


def test_the_server_default_deadline_applies_when_the_request_names_none(strict):
    held: list = []
    thread = hold_device(strict, held)
    late = httpx.post(f"{strict}/v1/encode", json=body(["no timeout_s given"]), timeout=30)
    thread.join(30)

    assert late.status_code == 504, late.text
    assert late.json()["error"]["details"]["phase"] == "queue"
    assert held[0].status_code == 200  # it named its own, longer deadline


# --- admission ----------------------------------------------------------------------------------


def test_a_request_whose_estimated_tokens_exceed_the_whole_queue_is_400_naming_the_limit(strict):
    long_texts = ["word " * 400] * 5  # ~256 tokens each once truncated: ~1280 > 1000

    response = httpx.post(f"{strict}/v1/encode", json=body(long_texts), timeout=30)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["details"]["max_queue_tokens"] == 1000 and "split" in error["message"]
    assert "retry-after" not in response.headers


def test_admission_counts_tokens_not_items_and_a_full_queue_is_503_with_retry_after(strict):
    held: list = []
    hog = in_background(
        lambda: held.append(
            httpx.post(
                f"{strict}/v1/encode", json=body([f"{SLOW_WORD} " + "word " * 400] * 3, timeout_s=60), timeout=60
            )
        )
    )
    time.sleep(0.3)
    refused = httpx.post(f"{strict}/v1/encode", json=body(["word " * 400] * 2), timeout=30)  # two items only
    short = httpx.post(f"{strict}/v1/encode", json=body(["hi"] * 20, timeout_s=30), timeout=30)  # 20 items fit
    hog.join(60)

    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded" and "tokens" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert short.status_code == 200, short.text
    assert held[0].status_code == 200


def test_retry_after_is_the_token_backlog_over_the_measured_rate():
    from shoal.engine.admission import PROMISE_MARGIN, Admission

    rate: list[float | None] = [100.0]  # tokens/s, as if measured
    admission = Admission(8192, 1000, None, lambda model_id: rate[0])
    admission.add(MODEL_ID, 3, 900)
    with pytest.raises(Exception) as info:
        admission.admit(MODEL_ID, 1, 500, 300.0)
    assert info.value.code == "overloaded"
    assert info.value.retry_after_s == math.ceil(PROMISE_MARGIN * (900 + 500 - 1000) / 100.0)
    rate[0] = None  # nothing measured yet: a short default
    admission = Admission(8192, 1000, None, lambda model_id: rate[0])
    admission.add(MODEL_ID, 3, 900)
    with pytest.raises(Exception) as info:
        admission.admit(MODEL_ID, 1, 500, 300.0)
    assert info.value.retry_after_s == 1.0


# --- failure isolation --------------------------------------------------------------------------


def test_a_failing_item_fails_only_its_own_request_with_a_request_id_and_no_internal_text(wrapped, reference_model):
    url, runner, engine = wrapped
    good_a = ["first client, first text", "first client, second text"]
    bad = ["harmless", f"this one is {POISON_WORD}", "also harmless"]
    good_c = ["third client text"]
    held: list = []
    thread = hold_device(url, held, engine.device_lanes)  # the three requests below queue up behind it
    seen = len(runner.batches)

    async def three():
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            return await asyncio.gather(
                http.post("/v1/encode", json=body(good_a)),
                http.post("/v1/encode", json=body(bad), headers={"x-request-id": "req-poisoned-1"}),
                http.post("/v1/encode", json=body(good_c)),
            )

    a, b, c = asyncio.run(three())
    thread.join(30)

    if engine.device_lanes == 1:
        assert (len(good_a) + len(bad) + len(good_c), True) in runner.batches[seen:]  # they did share a batch
    else:  # the two lanes split them; the poisoned batch held other items too
        assert any(poisoned and n > 1 for n, poisoned in runner.batches[seen:]), runner.batches[seen:]
    assert a.status_code == 200 and c.status_code == 200, (a.text, c.text)
    assert cosine_ok(a.json()["items"], reference_model, good_a)
    assert cosine_ok(c.json()["items"], reference_model, good_c)
    assert b.status_code == 500
    error = b.json()["error"]
    assert error["code"] == "inference_failed"
    assert error["details"] == {"request_id": "req-poisoned-1", "index": 1}
    assert "req-poisoned-1" in error["message"] and SECRET not in b.text and "RuntimeError" not in b.text
    assert b.headers["x-request-id"] == "req-poisoned-1"


def test_a_dead_device_thread_fails_its_work_with_503_turns_readyz_503_and_is_restarted(wrapped):
    url, _, engine = wrapped
    scheduler = engine._device._scheduler
    real_next_batch = scheduler.next_batch
    restarts_before = metric(url, "shoal_device_restarts_total")

    def broken(*args):
        scheduler.next_batch = real_next_batch  # once
        raise RuntimeError("scheduler bug")

    scheduler.next_batch = broken
    failed = httpx.post(f"{url}/v1/encode", json=body(["sent as the thread dies"]), timeout=10)
    ready_while_dead = httpx.get(f"{url}/readyz")
    refused_while_dead = httpx.post(f"{url}/v1/encode", json=body(["sent while it is dead"]), timeout=10)

    assert failed.status_code == 503 and failed.json()["error"]["code"] == "overloaded", failed.text
    assert "retry-after" in failed.headers
    assert ready_while_dead.status_code == 503
    assert refused_while_dead.status_code == 503
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the device thread was not restarted"
        time.sleep(0.1)
    after = httpx.post(f"{url}/v1/encode", json=body(["after the restart"]), timeout=30)
    assert after.status_code == 200, after.text
    assert metric(url, "shoal_device_restarts_total") == restarts_before + 1


# --- bounded results and long texts ---------------------------------------------------------------


def test_a_result_larger_than_the_limit_is_400_saying_how_to_split(strict):
    texts = [f"text {i}" for i in range(100)]  # 100 x 384 float32 = 153,600 bytes > 100,000

    response = httpx.post(f"{strict}/v1/encode", json=body(texts), timeout=30)
    smaller = httpx.post(f"{strict}/v1/encode", json=body(texts[:60], output_dtype="int8"), timeout=30)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "result_too_large"
    assert (
        error["details"]["max_items"] == 100_000 // (384 * 4) and f"at most {100_000 // 1536} items" in error["message"]
    )
    assert smaller.status_code == 200, smaller.text  # int8 is a quarter of the size


def test_a_4_mib_text_is_cut_before_tokenizing_and_embeds_like_its_truncated_reference(strict, reference_model):
    text = "The reef is home to shoals of fish. " * (4 * 1024 * 1024 // 36)

    response = httpx.post(f"{strict}/v1/encode", json=body([text], timeout_s=30), timeout=60)

    assert response.status_code == 200, response.text
    out = response.json()
    assert out["usage"]["tokens"] == 256  # MiniLM's max_length: truncated, as the reference truncates
    assert out["timings"]["tokenize_ms"] < 1000  # ~2.6k characters tokenized, not 4 MiB
    assert cosine_ok(out["items"], reference_model, [text[:20_000]])


def test_a_client_request_id_is_echoed_and_a_bad_one_is_replaced(wrapped):
    url, _, _ = wrapped
    given = httpx.post(f"{url}/v1/encode", json=body(["hi"]), headers={"x-request-id": "trace-42"})
    bad = httpx.post(f"{url}/v1/encode", json=body(["hi"]), headers={"x-request-id": "x" * 500})

    assert given.headers["x-request-id"] == "trace-42"
    assert bad.headers["x-request-id"] != "x" * 500 and len(bad.headers["x-request-id"]) == 16


def test_a_large_response_is_encoded_in_a_worker_thread_and_a_small_one_on_the_loop(wrapped, monkeypatch):
    import shoal.api.app as app_module

    url, _, _ = wrapped
    threads: list[str] = []
    real = app_module._encode_large

    def spy(result, fmt):
        threads.append(threading.current_thread().name)
        return real(result, fmt)

    monkeypatch.setattr(app_module, "_encode_large", spy)
    small = httpx.post(f"{url}/v1/encode", json=body(["one"]), timeout=60)
    assert small.status_code == 200 and threads == []  # 1.5 KB: encoded right on the loop
    large = httpx.post(f"{url}/v1/encode", json=body([f"text {i}" for i in range(1024)]), timeout=120)
    assert large.status_code == 200 and len(large.json()["items"]) == 1024
    assert len(threads) == 1 and threads[0] != "uvicorn"  # 1.5 MB of vectors: off the event loop


def test_batches_are_cut_by_time_only_while_small_and_large_requests_share_the_device():
    import time as clock

    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import Engine

    engine = Engine(EngineSettings(target_batch_s=0.1, min_batch_tokens=256), Catalog.load(), allow_download=False)
    device = engine._device
    device._model_rates[MODEL_ID] = 5000.0  # tokens/s, as if measured
    full = engine._limits_for(MODEL_ID).max_batch_tokens  # the card's CPU budget (4096)

    device._large_live = 1  # a bulk job alone: full batches
    assert engine._limits_for(MODEL_ID).max_batch_tokens == full
    device._small_seen_at = clock.monotonic()  # a one-sentence request joins it
    assert engine._limits_for(MODEL_ID).max_batch_tokens == 500  # 0.1 s at 5,000 tokens/s
    device._model_rates[MODEL_ID] = 100.0
    assert engine._limits_for(MODEL_ID).max_batch_tokens == 256  # never below min_batch_tokens
    device._large_live = 0  # the bulk job is done: small requests alone get full batches
    assert engine._limits_for(MODEL_ID).max_batch_tokens == full
    device._large_live, device._small_seen_at = 1, clock.monotonic() - 10  # no small request for 10 s
    assert engine._limits_for(MODEL_ID).max_batch_tokens == full
