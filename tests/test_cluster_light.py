"""The cluster's gateway and worker loop over a real nats-server, with in-memory stand-in services
(torch-free: CI also runs this file where only `pip install 'shoal[cluster]'` is installed).

Each test runs a `RemoteService` (the gateway's service) and `Worker`s in one event loop, on its
own pool of the module's nats-server, so tests never see each other's queue. What needs real
models and real processes (kill -9, restarts, HTTP parity with `shoal serve`) is in
tests/test_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest
from nats.errors import TimeoutError as NatsTimeout

sys.path.insert(0, str(Path(__file__).parent))

from shoal import calls
from shoal.calls import EncodeCall, ScoreCall
from shoal.catalog import Catalog
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port
from shoal.cluster.gateway import RemoteService
from shoal.cluster.worker import Worker
from shoal.config import ClusterSettings, EngineSettings, Settings
from shoal.errors import DeadLetter, DeadlineExceeded, NoWorker, UnknownModel
from shoal.metrics import Metrics
from shoal.verbs import estimate_tokens
from standin import RERANK_MODEL, StandIn

MODEL = "standin/dense-16"

pytestmark = [pytest.mark.light, pytest.mark.timeout(120)]


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Slow(StandIn):
    """A stand-in whose calls wait for `gate` (set: they run at once), counting the calls it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.started: list[str] = []

    async def run(self, call):
        self.started.append(call.request_id)
        await self.gate.wait()
        return await super().run(call)


@contextlib.asynccontextmanager
async def cluster(nats_url: str, pool: str, services: list[list], **cluster_options):
    """A gateway and one worker per entry of `services` (a worker's list: one service per device)."""
    settings = ClusterSettings(nats_url=nats_url, pool=pool, heartbeat_s=0.2, worker_ttl_s=2.0, **cluster_options)
    gateway = RemoteService(Settings(cluster=settings, engine=EngineSettings(request_timeout_s=30.0)), Catalog.load())
    await gateway.start()
    stop = asyncio.Event()
    workers = [Worker(devices, settings, metrics=Metrics()) for devices in services]
    tasks = [asyncio.create_task(worker.run(stop)) for worker in workers]
    try:
        deadline = time.monotonic() + 20
        while not (gateway.ready and len({b.worker for b in gateway.workers.live() if b.pool == pool}) == len(workers)):
            assert time.monotonic() < deadline, "the gateway never saw its workers"
            await asyncio.sleep(0.05)
        yield gateway, workers
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await gateway.stop()


def run(coro):
    return asyncio.run(coro)


async def until(condition, what: str, timeout_s: float = 20.0) -> None:
    """Wait for `condition()`; fail naming `what` if it does not hold within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def test_every_verb_round_trips_and_equals_the_service_run_in_process(nats_url):
    async def body():
        reference = StandIn()
        async with cluster(nats_url, "verbs", [[StandIn()], [StandIn()]]) as (gateway, _):
            encode = EncodeCall(model=MODEL, items=["a fish", "a shoal of fish", "ünïcödé 🐟"])
            got = await gateway.run(encode)
            want = await reference.run(encode)
            assert np.array_equal(np.stack(got.vectors), np.stack(want.vectors))
            assert got.num_tokens == want.num_tokens
            score = ScoreCall(model=RERANK_MODEL, query="fish shoal", documents=["a shoal", "cake", "fish"])
            got_s, want_s = await gateway.run(score), await reference.run(score)
            assert [(i.index, i.score) for i in got_s.items] == [(i.index, i.score) for i in want_s.items]
            # An error on the worker comes back as itself.
            with pytest.raises(Exception) as caught:
                await gateway.run(EncodeCall(model=MODEL, items=["x"], dimensions=10_000))
            assert type(caught.value).__name__ == "InvalidRequest" and "dimensions" in caught.value.message
            # tokenize, detokenize and admin travel to the workers too.
            tokens = (await gateway.tokenize(MODEL, ["two words"]))[0]
            assert [t.text for t in tokens] == ["[CLS]", "two", "words", "[SEP]"]
            assert await gateway.detokenize(MODEL, [[t.id for t in tokens]]) == ["two words"]
            assert await gateway.detokenize(MODEL, [[t.id for t in tokens]], False) == ["[CLS] two words [SEP]"]
            with pytest.raises(Exception) as caught:
                await gateway.detokenize(MODEL, [[7]])
            assert type(caught.value).__name__ == "InvalidRequest" and "token id 7" in caught.value.message
            status = await gateway.admin(MODEL, "load")
            assert status.loaded and status.state == "loaded"
            # The workers' heartbeats carry it within a beat.
            await asyncio.sleep(0.5)
            assert gateway.model(MODEL).state == "loaded"

    run(body())


def test_a_model_no_worker_serves_is_503_with_retry_after_and_counts_as_demand(nats_url):
    async def body():
        async with cluster(nats_url, "demand", [[StandIn()]]) as (gateway, _):
            known = "BAAI/bge-small-en-v1.5"  # a catalog card no worker here serves
            assert gateway.model(known).state == "no_worker"
            for _ in range(3):
                with pytest.raises(NoWorker) as caught:
                    await gateway.run(EncodeCall(model=known, items=["x"]))
            assert caught.value.retry_after_s >= 1
            assert sample(gateway.metrics, "shoal_gateway_demand", model=known) == 3
            assert sample(gateway.metrics, "shoal_gateway_unserved_requests_total", model=known) == 3
            with pytest.raises(UnknownModel):
                await gateway.run(EncodeCall(model="no/such-model", items=["x"]))

    run(body())


def test_work_pulled_for_the_host_goes_to_the_device_that_is_free(nats_url):
    """Two devices share one host queue: with one device stuck, every call is served by the other,
    none goes back to NATS (no nak, no redelivery)."""

    async def body():
        stuck, free = Slow(), StandIn()
        stuck.gate.clear()
        # Budgets of one token: a device holds one call at a time, so the stuck one holds just its first.
        async with cluster(nats_url, "host", [[stuck, free]], min_inflight_tokens=1) as (gateway, [worker]):
            first = asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["held"])))
            await until(lambda: stuck.started, "the stuck device took the first call")
            results = await asyncio.gather(
                *[gateway.run(EncodeCall(model=MODEL, items=[f"text {i}"])) for i in range(20)]
            )
            assert len(results) == 20 and len(free.calls) == 20 and len(stuck.started) == 1
            assert sample(worker.metrics, "shoal_worker_redelivered_calls_total", model=MODEL) == 0
            stuck.gate.set()
            await first
            assert sample(worker.metrics, "shoal_worker_calls_total", model=MODEL, outcome="ok") == 21

    run(body())


def test_a_call_whose_deadline_passed_in_the_queue_is_never_computed(nats_url):
    async def body():
        service = Slow()
        async with cluster(nats_url, "deadline", [[service]]) as (gateway, [worker]):
            # A call left in the queue past its deadline (its gateway died before deleting it).
            nc = gateway._nc
            inbox = nc.new_inbox()
            replies = await nc.subscribe(inbox)
            call = EncodeCall(model=MODEL, items=["too late"], request_id="late-1")
            await gateway._js.publish(
                p.work_subject("deadline", MODEL),
                calls.encode(call),
                headers={p.REQUEST_ID: "late-1", p.DEADLINE: f"{p.now() - 1:.3f}", p.TOKENS: "4", p.REPLY: inbox},
            )
            deadline = time.monotonic() + 10
            while sample(worker.metrics, "shoal_worker_calls_total", model=MODEL, outcome="dropped_deadline") < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert "late-1" not in service.started
            with pytest.raises(NatsTimeout):
                await replies.next_msg(timeout=0.3)  # nobody is answered for it
            # Through the gateway: while the device is busy with a call as large as its budget, the
            # worker pulls nothing more; the second call's deadline passes in the queue, the gateway
            # deletes it there, and it is never computed.
            service.gate.clear()
            busy = asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["x " * 10_000], request_id="busy")))
            await until(lambda: "busy" in service.started, "the busy call started")
            with pytest.raises(DeadlineExceeded):
                await gateway.run(EncodeCall(model=MODEL, items=["short"], timeout_s=0.5, request_id="short"))
            service.gate.set()
            await busy
            await asyncio.sleep(0.5)
            assert "short" not in service.started
            assert sample(gateway.metrics, "shoal_gateway_abandoned_calls_total", model=MODEL, reason="deadline") == 1
            info = await gateway._js.stream_info(p.STREAM)
            assert info.state.messages == 0

    run(body())


def test_what_a_worker_pulled_beyond_its_room_goes_back_to_the_queue_and_is_served_later(nats_url):
    async def body():
        settings = ClusterSettings(nats_url=nats_url, pool="overpull", heartbeat_s=0.2)
        async with cluster(nats_url, "overpull-gw", [[StandIn()]]) as (gateway, _):
            nc, js = gateway._nc, gateway._js
            await p.ensure_consumer(js, settings, "overpull", MODEL)
            inbox = nc.new_inbox()
            replies = await nc.subscribe(inbox, max_msgs=5)
            # A one-word call first: the worker learns "calls here are ~4 tokens" and asks for as many
            # more as fit its 4,096-token room at that size, so it receives all four ~1,200-token
            # calls behind it at once; the device holds the first (the gate is shut), so only some
            # fit, and the rest go back to the queue.
            for i, words in enumerate([1, 1_200, 1_200, 1_200, 1_200]):
                call = EncodeCall(model=MODEL, items=["word " * words], request_id=f"big{i}")
                await js.publish(
                    p.work_subject("overpull", MODEL),
                    calls.encode(call),
                    headers={
                        p.REQUEST_ID: f"big{i}",
                        p.DEADLINE: f"{p.now() + 60:.3f}",
                        p.TOKENS: str(estimate_tokens(call, None)),
                        p.REPLY: inbox,
                    },
                )
            service = Slow()
            service.gate.clear()
            worker = Worker([service], settings, metrics=Metrics())
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            await until(
                lambda: sample(worker.metrics, "shoal_worker_naks_total", model=MODEL, reason="over_pulled") >= 1,
                "a call pulled beyond the room was handed back",
            )
            service.gate.set()
            answered = []
            for _ in range(5):
                answered.append(calls.decode_result((await replies.next_msg(timeout=20)).data).request_id)
            assert sorted(answered) == [f"big{i}" for i in range(5)]
            assert sample(worker.metrics, "shoal_worker_redelivered_calls_total", model=MODEL) >= 1
            assert len(service.calls) == 5  # each computed once
            stop.set()
            await asyncio.wait_for(task, 20)

    run(body())


def test_a_call_running_longer_than_ack_wait_is_kept_by_in_progress_not_redelivered(nats_url):
    async def body():
        service, sibling = Slow(), StandIn()
        service.gate.clear()
        async with cluster(nats_url, "long", [[service]], ack_wait_s=1.0) as (gateway, [worker]):
            long = asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["long"], request_id="long")))
            await until(lambda: "long" in service.started, "the long call started")
            # A sibling that would take the call if it were redelivered.
            settings = ClusterSettings(nats_url=nats_url, pool="long", heartbeat_s=0.2, ack_wait_s=1.0)
            other = Worker([sibling], settings, metrics=Metrics())
            stop = asyncio.Event()
            task = asyncio.create_task(other.run(stop))
            await asyncio.sleep(3.0)  # three ack_waits
            service.gate.set()
            result = await long
            assert result.request_id == "long" and service.started == ["long"] and sibling.calls == []
            for w in (worker, other):
                assert sample(w.metrics, "shoal_worker_redelivered_calls_total", model=MODEL) == 0
            stop.set()
            await asyncio.wait_for(task, 20)

    run(body())


def test_a_caller_that_goes_away_has_its_held_call_dropped(nats_url):
    async def body():
        service = Slow()
        async with cluster(nats_url, "cancel", [[service]], min_inflight_tokens=1_000_000) as (gateway, [worker]):
            service.gate.clear()
            first = asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["first"], request_id="first")))
            await until(lambda: "first" in service.started, "the first call started")
            # The device runs one call at a time only if its budget says so; here it takes both, so
            # the second is running (held by the engine) when its caller goes away.
            second = asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["second"], request_id="second")))
            await until(lambda: "second" in service.started, "the second call started")
            second.cancel()
            deadline = time.monotonic() + 10
            while sample(worker.metrics, "shoal_worker_calls_total", model=MODEL, outcome="dropped_cancelled") < 1:
                assert time.monotonic() < deadline, "the worker never dropped the cancelled call"
                await asyncio.sleep(0.05)
            service.gate.set()
            await first
            assert [c.request_id for c in service.calls] == ["first"]  # "second" never produced a result

    run(body())


def test_a_call_delivered_max_deliver_times_is_a_dead_letter_answered_with_its_request_id(nats_url):
    """A worker that dies on a call (here: a pull consumer that never acks, as a killed process)
    makes JetStream give up after max_deliver; the gateway answers the caller 5xx with the id."""

    async def body():
        settings = ClusterSettings(nats_url=nats_url, pool="dead", ack_wait_s=0.5, max_deliver=2, heartbeat_s=0.2)
        gateway = RemoteService(Settings(cluster=settings), Catalog.load())
        await gateway.start()
        try:
            await until(lambda: gateway.ready, "the gateway connected")
            nc, js = gateway._nc, gateway._js
            model = StandIn().models()[0]
            await p.ensure_consumer(js, settings, "dead", model.id)
            sub = await js.pull_subscribe(
                p.work_subject("dead", model.id), durable=p.consumer_name("dead", model.id), stream=p.STREAM
            )
            beat = p.Heartbeat(worker="dying", pool="dead", host="h", devices=("x",), models=[model], free_tokens=9)

            async def heartbeats():
                while True:
                    await nc.publish(f"{p.HEARTBEAT_PREFIX}.dying", msgspec.msgpack.encode(beat))
                    await asyncio.sleep(0.2)

            beating = asyncio.create_task(heartbeats())
            await asyncio.sleep(0.3)
            call = asyncio.create_task(gateway.run(EncodeCall(model=model.id, items=["poison"], request_id="doomed")))
            deliveries = []

            async def die_on_each():  # take it and "die" (never ack), as long as JetStream delivers it
                while True:
                    try:
                        deliveries.extend(await sub.fetch(1, timeout=1))
                    except (NatsTimeout, asyncio.TimeoutError):  # nothing to fetch
                        pass

            dying = asyncio.create_task(die_on_each())
            with pytest.raises(DeadLetter) as caught:
                await asyncio.wait_for(call, 15)
            dying.cancel()
            assert len(deliveries) == 2
            assert caught.value.details["request_id"] == "doomed" and "doomed" in caught.value.message
            assert sample(gateway.metrics, "shoal_dead_letters_total", model=model.id) == 1
            beating.cancel()
        finally:
            await gateway.stop()

    run(body())


def test_a_draining_worker_pulls_no_more_finishes_what_it_runs_and_leaves_the_rest_to_a_sibling(nats_url):
    async def body():
        draining = Slow()
        draining.gate.clear()
        # A budget of one token: the worker holds one call at a time, the others wait in the queue.
        async with cluster(nats_url, "drain", [], min_inflight_tokens=1) as (gateway, _):
            settings = ClusterSettings(
                nats_url=nats_url, pool="drain", heartbeat_s=0.2, worker_ttl_s=2.0, min_inflight_tokens=1
            )
            stop = asyncio.Event()
            worker = Worker([draining], settings, metrics=Metrics())
            task = asyncio.create_task(worker.run(stop))
            await until(lambda: gateway.workers.served().get(MODEL), "the gateway saw the worker")
            pending = [
                asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=[f"t{i}"], request_id=f"r{i}")))
                for i in range(12)
            ]
            await until(lambda: draining.started, "the draining worker started a call")
            stop.set()  # what SIGTERM does in `shoal worker`
            await asyncio.sleep(0.5)
            assert not gateway.workers.served().get(MODEL)  # it said it is draining: the gateway stops counting on it
            draining.gate.set()  # the call it runs finishes during the drain
            await asyncio.wait_for(task, 20)
            assert draining.calls and [c.request_id for c in draining.calls] == draining.started
            sibling = StandIn()
            other = Worker([sibling], settings, metrics=Metrics())
            sibling_stop = asyncio.Event()
            sibling_task = asyncio.create_task(other.run(sibling_stop))
            results = await asyncio.wait_for(asyncio.gather(*pending), 20)
            assert [r.request_id for r in results] == [f"r{i}" for i in range(12)]
            ran = [c.request_id for c in draining.calls] + [c.request_id for c in sibling.calls]
            assert sorted(ran) == sorted(f"r{i}" for i in range(12))  # each once
            sibling_stop.set()
            await asyncio.wait_for(sibling_task, 20)

    run(body())


def test_a_worker_answers_its_probes_starting_pulling_wedged_and_draining(nats_url):
    """`/healthz` and `/readyz` beside `/metrics` (what the Helm chart's probes ask): ready only while it
    pulls; not live while its event loop is wedged (the probes run on their own thread)."""
    import httpx

    from shoal.cluster.worker import serve_probes

    async def body():
        service = Slow()
        async with cluster(nats_url, "probes", []) as (gateway, _):
            settings = ClusterSettings(nats_url=nats_url, pool="probes", heartbeat_s=0.2, worker_ttl_s=2.0)
            worker = Worker([service], settings, metrics=Metrics())
            port = free_port()
            server = serve_probes(worker, "127.0.0.1", port)

            def get(path: str) -> httpx.Response:
                return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)

            try:
                starting = await asyncio.to_thread(get, "/readyz")
                assert (await asyncio.to_thread(get, "/healthz")).status_code == 200
                assert starting.status_code == 503 and "starting" in starting.text
                stop = asyncio.Event()
                task = asyncio.create_task(worker.run(stop))
                await until(worker.started.is_set, "the worker pulls")
                await asyncio.sleep(0.3)
                ready = await asyncio.to_thread(get, "/readyz")
                assert ready.status_code == 200 and ready.text.strip() == "pulling"
                assert "shoal_worker_held_tokens" in (await asyncio.to_thread(get, "/metrics")).text
                assert (await asyncio.to_thread(get, "/nope")).status_code == 404
                # Wedge the event loop for 6.5 s; a probe thread asks while it is stuck.
                with ThreadPoolExecutor(1) as side:
                    probe = side.submit(lambda: (time.sleep(5.8), get("/healthz"))[1])
                    time.sleep(6.5)
                    wedged = probe.result()
                assert wedged.status_code == 503 and "heartbeat loop" in wedged.text
                await asyncio.sleep(0.5)  # the loop turns again: live
                assert (await asyncio.to_thread(get, "/healthz")).status_code == 200
                service.gate.clear()
                pending = asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["held"], request_id="p1")))
                await until(lambda: service.started, "the worker started the call")
                stop.set()
                await until(lambda: worker.draining, "the worker drains")
                draining = await asyncio.to_thread(get, "/readyz")
                assert draining.status_code == 503 and "draining" in draining.text
                service.gate.set()
                assert (await asyncio.wait_for(pending, 20)).request_id == "p1"
                await asyncio.wait_for(task, 20)
            finally:
                server.shutdown()

    run(body())


def test_per_model_counters_have_a_series_at_zero_before_anything_happens(nats_url):
    """An alert on `increase(shoal_dead_letters_total[5m]) > 0` must see the first dead letter: the
    series exists (at 0) from the first scrape, for every model of the catalog."""
    settings = ClusterSettings(nats_url=nats_url, pool="zeros")
    gateway = RemoteService(Settings(cluster=settings), Catalog.load())
    worker = Worker([StandIn()], settings, metrics=Metrics())
    for model in ("sentence-transformers/all-MiniLM-L6-v2", "BAAI/bge-small-en-v1.5"):  # the gateway's catalog
        assert gateway.metrics.registry.get_sample_value("shoal_dead_letters_total", {"model": model}) == 0.0
        assert gateway.metrics.registry.get_sample_value("shoal_gateway_demand", {"model": model}) == 0.0
        assert (
            gateway.metrics.registry.get_sample_value(
                "shoal_gateway_abandoned_calls_total", {"model": model, "reason": "deadline"}
            )
            == 0.0
        )
    for direction in ("call", "result"):
        assert (
            gateway.metrics.registry.get_sample_value("shoal_gateway_object_payloads_total", {"direction": direction})
            == 0.0
        )
    for model in (MODEL, RERANK_MODEL):  # the models its service serves
        assert (
            worker.metrics.registry.get_sample_value("shoal_worker_calls_total", {"model": model, "outcome": "error"})
            == 0.0
        )


def test_the_gateway_shows_each_consumers_pending_and_unacked_calls(nats_url, monkeypatch):
    """What KEDA's nats-jetstream trigger scales on is also on the gateway's /metrics, per pool and
    model: calls waiting in the queue, and calls delivered to a worker and not yet acked."""
    from shoal.cluster import queue_gauges

    monkeypatch.setattr(queue_gauges, "POLL_S", 0.1)

    def gauges(gateway, pool):
        labels = {"pool": pool, "model": MODEL}
        return (
            gateway.metrics.registry.get_sample_value("shoal_queue_pending_calls", labels),
            gateway.metrics.registry.get_sample_value("shoal_queue_unacked_calls", labels),
        )

    async def body():
        service = Slow()
        service.gate.clear()
        async with cluster(nats_url, "gauges", [[service]]) as (gateway, _):
            # A pool with a consumer and no worker (scaled to zero): its calls wait, pending.
            settings = ClusterSettings(nats_url=nats_url, pool="gauges-idle")
            await p.ensure_consumer(gateway._js, settings, "gauges-idle", MODEL)
            for i in range(2):
                await gateway._js.publish(p.work_subject("gauges-idle", MODEL), b"", headers={p.REQUEST_ID: f"idle{i}"})
            await until(lambda: gauges(gateway, "gauges-idle") == (2, 0), "2 pending calls of the idle pool")
            await until(lambda: gauges(gateway, "gauges") == (0, 0), "the served pool's gauges at 0")
            # Held by the worker (running, or handed back with a delay: JetStream counts both as
            # unacked): five calls of ~3,000 tokens, none answered while the gate is shut.
            running = [
                asyncio.create_task(gateway.run(EncodeCall(model=MODEL, items=["word " * 2_400], request_id=f"g{i}")))
                for i in range(5)
            ]
            await until(
                lambda: (
                    service.started
                    and (gauges(gateway, "gauges")[1] or 0) >= 1
                    and sum(v or 0 for v in gauges(gateway, "gauges")) == 5
                ),
                "the 5 calls shown",
            )
            service.gate.set()
            await asyncio.gather(*running)
            await until(lambda: gauges(gateway, "gauges") == (0, 0), "the gauges back at 0 once all are answered")
            await gateway._js.delete_consumer(p.STREAM, p.consumer_name("gauges-idle", MODEL))
            await until(lambda: gauges(gateway, "gauges-idle") == (None, None), "a deleted consumer's series gone")

    run(body())


def test_a_gateway_makes_the_consumers_of_a_pool_that_has_no_worker_yet(nats_url):
    """`--pool-models`: the consumers of a pool scaled to zero exist before its first worker, with
    the settings a worker gives them, so KEDA reads their lag (0), not the whole stream's."""

    async def body():
        settings = ClusterSettings(nats_url=nats_url, pool="any", ack_wait_s=12.0, max_deliver=3)
        gateway = RemoteService(
            Settings(cluster=settings), Catalog.load(), consumers=(("cold", MODEL), ("cold", RERANK_MODEL))
        )
        await gateway.start()
        try:
            await until(lambda: gateway.ready, "the gateway ready")
            for model in (MODEL, RERANK_MODEL):
                info = await gateway._js.consumer_info(p.STREAM, p.consumer_name("cold", model))
                assert info.config.filter_subject == p.work_subject("cold", model)
                assert (info.config.ack_wait, info.config.max_deliver) == (12.0, 3)
                assert info.num_pending == 0
        finally:
            await gateway.stop()
        # A worker of the pool binds to the consumer it finds.
        async with cluster(nats_url, "cold", [[StandIn()]]) as (gateway, _):
            result = await gateway.run(EncodeCall(model=MODEL, items=["hello"], request_id="cold-1"))
            assert result.request_id == "cold-1"

    run(body())


def test_pool_models_flag_takes_pool_equals_models_and_refuses_anything_else(capsys):
    from shoal.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["gateway", "--pool-models", "gpu=BAAI/bge-m3,BAAI/bge-reranker-v2-m3", "--pool-models", "cpu=x/y"]
    )
    assert args.pool_models == [("gpu", ["BAAI/bge-m3", "BAAI/bge-reranker-v2-m3"]), ("cpu", ["x/y"])]
    for bad in ("gpu", "=x/y", "gpu=", "gpu=,"):
        with pytest.raises(SystemExit):
            parser.parse_args(["gateway", "--pool-models", bad])
        assert "expected POOL=MODEL[,MODEL...]" in capsys.readouterr().err


def test_only_shoals_consumer_names_are_read_back():
    for pool, model in [("default", "BAAI/bge-small-en-v1.5"), ("gpu_a", "x.y@z:1"), ("p", "naïve")]:
        assert p.consumer_of(p.consumer_name(pool, model)) == (pool, model)
    for other in ("someone-elses", "a__b__c", "a__b_zz", "x__y_5"):
        assert p.consumer_of(other) is None


def test_drain_timeout_flag_takes_seconds_and_refuses_anything_else(capsys):
    from shoal.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["worker", "--drain-timeout-s", "45"]).drain_timeout_s == 45.0
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["worker", "--drain-timeout-s", bad])
        assert exit_info.value.code == 2
        assert "expected seconds (a finite number >= 0)" in capsys.readouterr().err


def test_a_gateway_sends_a_model_to_its_freest_pool_and_follows_the_heartbeats_without_walking_workers_per_call(
    monkeypatch,
):
    """WorkerDirectory.pool_for: the pool whose workers serving the model have the most free tokens;
    worked out once while the served map stands (a call costs no walk over the model's holders,
    however many), again when a worker's heartbeat changes what it serves; NoWorker for a model
    nobody serves."""
    from prometheus_client import CollectorRegistry

    from shoal.cluster import directory as directory_module
    from shoal.cluster.directory import WorkerDirectory
    from shoal.metrics import GatewayMetrics

    monkeypatch.setattr(directory_module, "_SERVED_REUSE_S", 60.0)  # no rebuild by age on a slow machine
    model = StandIn().models()[0]
    directory = WorkerDirectory(ClusterSettings(), Catalog.load(), GatewayMetrics(CollectorRegistry()))

    def beat(worker: str, pool: str, free: int, models: list) -> None:
        data = msgspec.msgpack.encode(
            p.Heartbeat(worker=worker, pool=pool, host="h", devices=("x",), models=models, free_tokens=free)
        )
        asyncio.run(directory.on_heartbeat(type("Msg", (), {"data": data, "subject": f"shoal.hb.{worker}"})()))

    beat("a1", "a", 100, [model])
    beat("a2", "a", 100, [model])
    beat("b1", "b", 150, [model])
    assert directory.pool_for(model.id) == "a"  # 2 x 101 over 151
    walks = []
    original = WorkerDirectory.pool_of
    monkeypatch.setattr(
        WorkerDirectory, "pool_of", staticmethod(lambda holders: walks.append(len(holders)) or original(holders))
    )
    directory._served_cache = None  # as a heartbeat with news does
    assert [directory.pool_for(model.id) for _ in range(50)] == ["a"] * 50
    assert walks == [3]  # one walk for 50 calls
    beat("b2", "b", 200, [model])  # a new worker: the served map is rebuilt
    assert directory.pool_for(model.id) == "b"  # 151 + 201 over 202
    assert walks == [3, 4]
    with pytest.raises(NoWorker):
        directory.pool_for("nobody/serves-this")
