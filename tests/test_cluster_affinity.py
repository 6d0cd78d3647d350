"""Pull by model affinity, over a real nats-server (torch-free, like tests/test_cluster_light.py):
a worker pulls the calls of models its devices have loaded while it has room, and another model's
only when its host is idle (paying the load) or when nobody takes them.

Each test starts its workers one by one where the order decides who may take a call, so no
assertion rests on which of two waiting pulls JetStream serves first, and none on wall-clock time.
A worker's pull of a model it lacks asks only for a call already queued (`no_wait`), so an idle
worker polling never races one that has the model loaded and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from shoal.calls import EncodeCall
from shoal.catalog import Catalog
from shoal.cluster.gateway import RemoteService
from shoal.cluster.worker import Worker
from shoal.config import ClusterSettings, EngineSettings, Settings
from shoal.metrics import Metrics
from standin import StandIn
from test_cluster_light import sample, until

A, B = "standin/dense-16", "standin/dense-8-raw"

pytestmark = [pytest.mark.light, pytest.mark.timeout(120)]


class Resident(StandIn):
    """A stand-in device that holds at most `slots` models loaded: a call of another model loads it
    (counted in `loads`), evicting the least recently used. Calls whose request id starts with
    "hold" wait for `gate`; `started` lists every call's request id as it starts."""

    def __init__(self, loaded: tuple[str, ...] = (), slots: int = 2) -> None:
        super().__init__()
        self.warmed = list(loaded)  # StandIn's loaded models, least recently used first
        self.slots = slots
        self.loads = 0
        self.gate = asyncio.Event()
        self.started: list[str] = []

    async def run(self, call):
        self.started.append(call.request_id)
        if call.model in self.warmed:
            self.warmed.remove(call.model)
        else:
            self.loads += 1
            del self.warmed[: max(0, len(self.warmed) - self.slots + 1)]
        self.warmed.append(call.model)
        if call.request_id.startswith("hold"):
            await self.gate.wait()
        return await super().run(call)

    def served(self, model_id: str) -> list[str]:
        return [c.request_id for c in self.calls if c.model == model_id]


class Fleet:
    """A gateway on its own pool, and workers started one at a time (each with its own settings)."""

    def __init__(self, nats_url: str, pool: str, backlog_s: float = 0.1) -> None:
        self.nats_url, self.pool, self.backlog_s = nats_url, pool, backlog_s
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.workers: list[Worker] = []
        self.gateway = RemoteService(
            Settings(cluster=self.settings(), engine=EngineSettings(request_timeout_s=30.0)), Catalog.load()
        )

    def settings(self, **options) -> ClusterSettings:
        return ClusterSettings(
            nats_url=self.nats_url,
            pool=self.pool,
            heartbeat_s=0.2,
            worker_ttl_s=2.0,
            backlog_s=self.backlog_s,
            **options,
        )

    async def add(self, service: StandIn, **options) -> Worker:
        worker = Worker([service], self.settings(**options), metrics=Metrics())
        self.workers.append(worker)
        self.tasks.append(asyncio.create_task(worker.run(self.stop)))
        await until(lambda: worker.started.is_set(), "the worker pulls")
        await until(
            lambda: self.gateway.ready and worker.id in {b.worker for b in self.gateway.workers.live()},
            "the gateway sees the worker",
        )
        return worker

    def call(self, model_id: str, request_id: str) -> asyncio.Task:
        return asyncio.create_task(
            self.gateway.run(EncodeCall(model=model_id, items=["a fish"], request_id=request_id))
        )

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)
        await self.gateway.stop()


@contextlib.asynccontextmanager
async def fleet(nats_url: str, pool: str, backlog_s: float = 0.1):
    f = Fleet(nats_url, pool, backlog_s)
    await f.gateway.start()
    try:
        yield f
    finally:
        await f.close()


def run(coro):
    return asyncio.run(coro)


async def busy_and_loaded(f: Fleet, affinity: bool) -> tuple[Resident, Resident, asyncio.Task]:
    """Two workers with room: `loaded` has A loaded and is idle; `busy` has B loaded and runs a
    held call of B (never idle) and has A nowhere. `loaded` starts after `busy` took the held call."""
    busy, loaded = Resident(loaded=(B,)), Resident(loaded=(A,))
    await f.add(busy, model_affinity=affinity)
    held = f.call(B, "hold-b")
    await until(lambda: "hold-b" in busy.started, "the busy worker took the held call")
    await f.add(loaded, model_affinity=affinity)
    return busy, loaded, held


def test_calls_go_to_the_worker_that_has_their_model_loaded_not_to_a_busy_one_without_it(nats_url):
    """With affinity, 30 calls of A one after the other all go to the worker that has A loaded,
    though the other one has room and asks as often; without it, the other takes its share."""

    async def body():
        async with fleet(nats_url, "affinity-on") as f:
            busy, loaded, held = await busy_and_loaded(f, affinity=True)
            for i in range(30):
                await f.call(A, f"a{i}")
            assert len(loaded.served(A)) == 30 and busy.served(A) == []
            assert loaded.loads == 0
            busy.gate.set()
            await held
        async with fleet(nats_url, "affinity-off") as f:
            busy, loaded, held = await busy_and_loaded(f, affinity=False)
            for i in range(30):
                await f.call(A, f"a{i}")
            assert len(loaded.served(A)) + len(busy.served(A)) == 30
            assert busy.served(A), "without affinity the busy worker takes some of A's calls (and loads A)"
            assert busy.loads == 1
            busy.gate.set()
            await held

    run(body())


def looks(worker: Worker, model_id: str) -> dict[str, float]:
    """The worker's looks at a cold model's queue so far, by source (the gateways' backlog or JetStream)."""
    return {
        source: sample(worker.metrics, "shoal_worker_cold_looks_total", model=model_id, source=source)
        for source in ("backlog", "jetstream")
    }


@pytest.mark.parametrize("backlog_s", [0.1, 0.0], ids=["backlog-feed", "jetstream-looks"])
def test_an_idle_worker_with_nothing_loaded_takes_a_model_loaded_nowhere_and_loads_it_once(nats_url, backlog_s):
    """The idle worker's looks at A's queue read the gateway's backlog feed (cluster/backlog.py),
    past its first look (before the gateway published A's consumer, it asks JetStream); with the
    feed off (backlog_s 0), each look asks JetStream."""

    async def body():
        async with fleet(nats_url, f"cold-idle-{backlog_s:g}", backlog_s) as f:
            device = Resident()
            worker = await f.add(device)
            await asyncio.sleep(0.5)  # several backlog periods: the feed has A's consumer
            before = looks(worker, A)
            await asyncio.gather(*(f.call(A, f"a{i}") for i in range(10)))
            assert len(device.served(A)) == 10
            assert device.loads == 1 and device.model(A).loaded
            assert sample(worker.metrics, "shoal_worker_naks_total", model=A, reason="over_pulled") == 0
            after = looks(worker, A)
            if backlog_s:  # the feed's counts (a loop stalled past their age on a loaded machine: JetStream's)
                fed, asked = after["backlog"] - before["backlog"], after["jetstream"] - before["jetstream"]
                assert fed > asked, f"{fed} looks read the feed, {asked} asked JetStream"
            else:
                assert after["jetstream"] > before["jetstream"] and after["backlog"] == 0

    run(body())


def test_the_gateway_publishes_each_models_queue_as_jetstream_counts_it(nats_url):
    """With no worker, calls of A wait in their pool's queue: the backlog the gateway publishes on
    shoal.backlog.<pool> says as many are pending as JetStream's consumer info, none delivered."""
    import msgspec
    import nats

    from shoal.cluster import backlog
    from shoal.cluster import protocol as p

    async def body():
        pool = "backlog-feed"
        async with fleet(nats_url, pool) as f:
            nc = await nats.connect(nats_url)
            got: list[backlog.Backlog] = []

            async def on_backlog(msg):
                got.append(msgspec.msgpack.decode(msg.data, type=backlog.Backlog))

            await nc.subscribe(backlog.subject(pool), cb=on_backlog)
            js = nc.jetstream()
            await p.ensure_consumer(js, f.settings(), pool, A)
            for i in range(3):  # to the pool's subject, as a gateway would (it sends only to a pool with workers)
                await js.publish(p.work_subject(pool, A), b"", headers={p.REQUEST_ID: f"a{i}"})
            info = await js.consumer_info(p.STREAM, p.consumer_name(pool, A))
            assert info.num_pending == 3
            await until(lambda: any(b.models.get(A) == backlog.Counts(3, 0, 0) for b in got), "a backlog of 3 calls")
            assert {b.gateway for b in got} == {f.gateway.id}
            await js.purge_stream(p.STREAM, subject=p.work_subject(pool, A))
            await nc.close()

    run(body())


def test_calls_the_loaded_worker_has_no_room_for_go_to_an_idle_worker_that_loads_their_model(nats_url):
    """The worker with A loaded holds one call and has no room (a budget of one token); the calls
    of A behind it wait in the queue until an idle worker with nothing loaded takes them, paying
    one load, then pulls the rest of A as its own."""

    async def body():
        async with fleet(nats_url, "overflow") as f:
            full, idle = Resident(loaded=(A,)), Resident()
            await f.add(full, min_inflight_tokens=1)
            held = f.call(A, "hold-a")
            await until(lambda: "hold-a" in full.started, "the loaded worker took the held call")
            waiting = [f.call(A, f"a{i}") for i in range(10)]
            await asyncio.sleep(0)
            await f.add(idle)
            await asyncio.gather(*waiting)
            assert sorted(idle.served(A)) == sorted(f"a{i}" for i in range(10)) and full.served(A) == []
            assert idle.loads == 1
            full.gate.set()
            await held

    run(body())


def test_a_busy_worker_with_room_takes_a_model_nobody_takes_so_no_call_waits_for_ever(nats_url):
    """The only worker is never idle (it runs a held call of A) and has B loaded nowhere: a call of
    B is still served, by the probe that finds B's calls waiting with no delivery since its last
    look, while the held call still runs."""

    async def body():
        async with fleet(nats_url, "starving") as f:
            device = Resident(loaded=(A,))
            await f.add(device)
            held = f.call(A, "hold-a")
            await until(lambda: "hold-a" in device.started, "the worker took the held call")
            result = await f.call(B, "b0")  # within its deadline (30 s), or DeadlineExceeded
            assert result.request_id == "b0" and device.served(B) == ["b0"]
            assert not held.done(), "B was served while the worker was busy, not once it was idle"
            device.gate.set()
            await held

    run(body())
