"""bench/cluster_sim.py's simulation: virtual time, the simulated JetStream, and shoal's real
gateway and workers (RemoteService, Worker, Puller, HostQueue) running on them. Every run here is
deterministic (virtual time, seeded randomness) and takes a second or two of wall time at most;
nothing here reads a wall clock."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("nats")
sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))  # cluster_sim, sim_jetstream, virtual_time, cluster

import nats.errors

import cluster_sim
import sim_jetstream as sj
from cluster import Cost, Workload
from shoal.calls import EncodeCall
from shoal.catalog import Catalog
from virtual_time import run_virtual

MODELS = ["sim/a", "sim/b"]
COSTS = cluster_sim.Costs(
    sj.BusCosts(publish_s=10e-6, deliver_s=5e-6, ack_s=5e-6, fetch_s=5e-6, status_s=10e-6, core_s=1e-6, latency_s=1e-4),
    sj.ClientCosts(publish_s=100e-6, receive_s=20e-6, heartbeat_s=5e-6),
    sj.ClientCosts(pulled_s=200e-6),
)


def consumer_config(**overrides):
    config = {"durable_name": "c", "filter_subject": "shoal.work.p.m", "ack_wait": 1.0, "max_deliver": 3}
    return SimpleNamespace(**({"max_waiting": 512} | config | overrides))


def test_virtual_time_jumps_to_each_timer_and_a_wait_for_times_out_on_the_virtual_clock():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        after_sleep = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 5.0)
        return after_sleep, loop.time()

    after_sleep, after_timeout = run_virtual(main())
    assert after_sleep == pytest.approx(3600.0)
    assert after_timeout == pytest.approx(3605.0)


def test_a_timer_due_within_asyncio_clock_resolution_runs_with_the_clock_at_its_time():
    """asyncio runs a timer due within 1 ns early when other callbacks are ready; the virtual clock
    must still reach the timer's time, or code that waits "until t" waits 1e-16 s for ever."""

    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(2.95)
        when = math.nextafter(loop.time(), math.inf)  # one ulp ahead
        seen = []
        loop.call_soon(lambda: None)  # something ready at once: select() is not asked to wait
        loop.call_at(when, lambda: seen.append(loop.time()))
        await asyncio.sleep(0.001)
        return when, seen

    when, seen = run_virtual(main())
    assert seen == [when]


def test_a_stream_stores_one_publish_at_a_time_at_its_cost():
    """100 publishes at once to a stream whose server takes 1 ms each: the last PubAck comes
    after 100 ms of that server's time (plus a hop each way)."""

    async def main():
        loop = asyncio.get_running_loop()
        costs = sj.BusCosts(publish_s=1e-3, deliver_s=0, ack_s=0, fetch_s=0, status_s=0, core_s=0, latency_s=1e-4)
        bus = sj.Bus(loop, costs)
        js = bus.connect("gw", sj.ClientCosts()).jetstream()
        acks = await asyncio.gather(*(js.publish("shoal.work.p.m", b"x") for _ in range(100)))
        return loop.time(), sorted(a.seq for a in acks), bus.streams["SHOAL_WORK"].server.busy_s

    finished, seqs, busy = run_virtual(main())
    assert seqs == list(range(1, 101))
    assert busy == pytest.approx(0.1)
    assert finished == pytest.approx(0.1 + 2e-4)


def test_pull_requests_are_served_in_arrival_order_and_refused_past_max_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        bus = sj.Bus(loop, COSTS.bus)
        conn = bus.connect("w", sj.ClientCosts())
        js = conn.jetstream()
        await js.add_consumer("SHOAL_WORK", consumer_config(max_waiting=2))
        subs = [await js.pull_subscribe_bind(durable="c", stream="SHOAL_WORK") for _ in range(3)]
        first, second = (asyncio.create_task(s.fetch(1, timeout=10.0)) for s in subs[:2])
        await asyncio.sleep(0.01)
        started = loop.time()
        with pytest.raises(nats.errors.TimeoutError):
            await subs[2].fetch(1, timeout=10.0)  # a third waiting pull: 409, at once
        refused_after = loop.time() - started
        for body in (b"one", b"two"):
            await js.publish("shoal.work.p.m", body)
        return [m.data for m in await first], [m.data for m in await second], refused_after, bus.counts["409"]

    first, second, refused_after, conflicts = run_virtual(main())
    assert (first, second) == ([b"one"], [b"two"])
    assert conflicts == 1
    assert refused_after < 0.01


def test_an_unacked_call_is_redelivered_after_ack_wait_and_a_nak_after_its_delay_and_max_deliver_makes_a_dead_letter():
    async def main():
        loop = asyncio.get_running_loop()
        bus = sj.Bus(loop, COSTS.bus)
        js = bus.connect("w", sj.ClientCosts()).jetstream()
        await js.add_consumer("SHOAL_WORK", consumer_config(ack_wait=2.0, max_deliver=3))
        dead = await js.pull_subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.SHOAL_WORK.*", durable="gw")
        sub = await js.pull_subscribe_bind(durable="c", stream="SHOAL_WORK")
        await js.publish("shoal.work.p.m", b"call")
        (once,) = await sub.fetch(1, timeout=1.0)  # ... and never acked
        t_once = loop.time()
        (twice,) = await sub.fetch(1, timeout=10.0)
        t_twice = loop.time()
        await twice.nak(delay=0.5)
        (thrice,) = await sub.fetch(1, timeout=10.0)
        t_thrice = loop.time()
        await thrice.nak()
        (advisory,) = await dead.fetch(1, timeout=1.0)
        return (
            [m.metadata.num_delivered for m in (once, twice, thrice)],
            t_twice - t_once,
            t_thrice - t_twice,
            advisory.data,
        )

    deliveries, redelivered_after, nak_after, advisory = run_virtual(main())
    assert deliveries == [1, 2, 3]
    assert 2.0 <= redelivered_after < 2.01
    assert 0.5 <= nak_after < 0.51
    assert b'"deliveries": 3' in advisory


def _plan(cost, resident=None, duration_s=3.0):
    workload = Workload(MODELS, 1.1, 30.0)
    return cluster_sim.Plan(MODELS, cost, workload, resident, None, 1.0, float("inf"), 1.0, 5.0, duration_s, 0.75, 0)


def _cluster(num_workers, device_cost, cluster=None, resident=None):
    cluster = {"heartbeat_s": 0.5, "worker_ttl_s": 3.0} | (cluster or {})
    plan = _plan(device_cost, resident)
    return cluster_sim.SimCluster(
        cluster_sim.Design(), COSTS, [device_cost] * num_workers, plan, cluster, Catalog.load()
    )


def _calls(n, words=40, seed=0):
    rng = random.Random(seed)
    return [EncodeCall(model=rng.choice(MODELS), items=["word " * words], timeout_s=60.0) for _ in range(n)]


def test_real_gateway_and_workers_answer_every_call_exactly_once_in_virtual_time():
    """200 calls at once through RemoteService to 4 real Workers: each answered, each computed
    once (the devices ran each call's tokens once), nothing left in the stream, no redelivery."""
    random.seed(0)
    calls = _calls(200)

    async def main():
        loop = asyncio.get_running_loop()
        async with _cluster(4, Cost(0.002, 20e-6, 0.0, 8192)) as sim:
            started = loop.time()
            results = await asyncio.gather(*(sim.call(c) for c in calls))
            took = loop.time() - started
            ran = sum(d.tokens for d in sim.devices)
            return results, ran, took, len(sim.bus.messages), sim.bus.counts["redelivered"]

    results, ran, took, left, redelivered = run_virtual(main())
    assert [len(r.items) for r in results] == [1] * 200
    assert ran == sum(r.num_tokens for r in results)
    assert (left, redelivered) == (0, 0)
    assert 0.05 < took < 5.0  # 4 devices, 200 calls of ~50 tokens: about 0.1 s of device time each


def test_calls_held_by_a_worker_that_dies_are_redelivered_after_ack_wait_and_answered():
    random.seed(0)
    calls = _calls(40, words=200)

    async def main():
        loop = asyncio.get_running_loop()
        async with _cluster(2, Cost(0.2, 0.0, 0.0, 8192), {"ack_wait_s": 3.0}) as sim:
            started = loop.time()
            tasks = [asyncio.create_task(sim.call(c)) for c in calls]
            await asyncio.sleep(0.1)
            held = sim.workers[0].queue.held()
            await sim.kill(0)
            results = await asyncio.gather(*tasks)
            return held, results, sim.bus.counts["redelivered"], loop.time() - started

    held, results, redelivered, took = run_virtual(main())
    assert held > 0
    assert len(results) == 40 and all(r.items for r in results)
    assert redelivered >= 1
    assert took >= 3.0  # the dead worker's calls waited out ack_wait


def test_over_pulled_calls_are_naked_back_and_served():
    """Two models' pullers fill one small budget at once: what arrives without room goes back
    (nak with a delay) and is answered all the same."""
    random.seed(0)
    calls = _calls(60, words=300)

    async def main():
        async with _cluster(3, Cost(0.05, 50e-6, 0.0, 8192), {"min_inflight_tokens": 256}) as sim:
            results = await asyncio.gather(*(sim.call(c) for c in calls))
            return results, sim.bus.counts["nak"], len(sim.bus.messages)

    results, naks, left = run_virtual(main())
    assert len(results) == 60 and all(r.items for r in results)
    assert naks > 0
    assert left == 0


def test_a_ramp_step_measures_the_devices_busy_share_as_bench_cluster_does():
    """One step at half the fleet's peak: every call answered, the devices busy at least the share
    of their peak the tokens run take (more: half-full batches pay their fixed cost per fewer tokens)."""
    random.seed(0)
    cost = Cost(0.002, 20e-6, 0.0, 8192)
    workload = Workload(MODELS, 1.1, 30.0)
    half = 0.5 * 4 * cost.peak_tokens_per_s / workload.mean_tokens

    async def main():
        async with _cluster(4, cost) as sim:
            return await sim.step(half)

    step = run_virtual(main())
    assert step.ok and step.failed == 0
    assert step.achieved == pytest.approx(step.offered, rel=0.1)
    assert step.tokens_per_s / (4 * cost.peak_tokens_per_s) <= step.busy < 0.9
    assert step.tokens_per_s == pytest.approx(step.achieved * workload.mean_tokens, rel=0.1)


def test_burst_arrivals_from_a_start_whose_phase_ends_round_short_cross_every_phase_to_the_end():
    """A step starting at a virtual time where `start + 30 - start` is less than 30: bench/cluster.py's
    `next_arrival` still crosses the phase boundary there (it used to find phase 5 again from that
    boundary and redraw it for ever), the arrivals stay in order, and are 3x as dense on (1.5x) as
    off (0.5x)."""
    start = 100.55440211167333
    assert start + 6 * 5.0 - start < 6 * 5.0
    rng, times, arrival = random.Random("16 124.000 3"), [], start
    while (arrival := cluster_sim.real.next_arrival(rng, arrival, start, 124.0, 1.5, 5.0)) <= start + 40.0:
        times.append(arrival)
    assert times == sorted(times) and start < times[0]
    on = sum(1 for t in times if int((t - start) // 5.0) % 2 == 0)
    assert on / (len(times) - on) == pytest.approx(3.0, rel=0.2)
    assert len(times) / 40.0 == pytest.approx(124.0, rel=0.1)


def test_a_model_loaded_nowhere_is_pulled_by_an_idle_worker_with_a_no_wait_pull_and_loaded(caplog):
    """Affinity: two devices hold one model each loaded (sim/a, sim/b); sim/c's calls are taken only
    by cold pulls (a no_wait pull request to JetStream's API) of idle workers, which load it; no
    puller fails on the way (a failing turn is logged and retried, which would hide it)."""
    random.seed(0)
    caplog.set_level(logging.WARNING, logger="shoal.worker")
    models = ["sim/a", "sim/b", "sim/c"]
    calls = [EncodeCall(model="sim/c", items=["word " * 20], timeout_s=60.0) for _ in range(20)]
    cost = Cost(0.002, 20e-6, 0.0, 8192, swap_s=0.1)
    plan = cluster_sim.Plan(
        models, cost, Workload(models, 1.1, 30.0), 1, None, 1.0, float("inf"), 1.0, 5.0, 3.0, 0.75, 0
    )
    cluster = {"heartbeat_s": 0.5, "worker_ttl_s": 3.0}

    async def main():
        async with cluster_sim.SimCluster(
            cluster_sim.Design(), COSTS, [cost] * 2, plan, cluster, Catalog.load()
        ) as sim:
            loaded = [d.resident_models for d in sim.devices]
            results = await asyncio.gather(*(sim.call(c) for c in calls))
            after = [d.resident_models for d in sim.devices]
            return loaded, results, after, sum(d.swaps for d in sim.devices), sim.bus.counts["raw_pull"]

    loaded, results, after, swaps, raw_pulls = run_virtual(main())
    assert loaded == [["sim/a"], ["sim/b"]]
    assert len(results) == 20 and all(r.items for r in results)
    assert ["sim/c"] in after and swaps >= 1
    assert raw_pulls >= 1
    assert not [r.getMessage() for r in caplog.records if r.name == "shoal.worker"]


def test_pools_that_split_the_models_get_workers_by_their_share_of_the_calls_and_serve_only_their_own():
    """`--pool-models split`: model i in pool i mod P only, the workers dealt to the pools by their
    models' share of the calls (interleaved, so the last, slow devices spread over the pools); the
    real gateways send each call to the one pool that serves its model, and every call is answered
    by a device that serves it (a device asked for another model's call would fail it)."""
    split = cluster_sim.Design(pools=2, partition="pool", pool_models="split")
    models = ["sim/a", "sim/b", "sim/c", "sim/d"]
    order, pool_models = cluster_sim.pools_of(split, models, [0.5, 0.25, 0.15, 0.1], 8)
    assert pool_models == [["sim/a", "sim/c"], ["sim/b", "sim/d"]]
    assert order.count(0) == 5 and order.count(1) == 3  # 0.65 and 0.35 of 8
    assert 1 in order[:3] and 0 in order[-3:]  # dealt in turn, not in blocks
    assert cluster_sim.pools_of(cluster_sim.Design(pools=2), models, [0.25] * 4, 4) == ([0, 1, 0, 1], [models, models])

    random.seed(0)
    rng = random.Random(0)
    calls = [EncodeCall(model=rng.choice(models), items=["word " * 20], timeout_s=60.0) for _ in range(80)]
    cost = Cost(0.002, 20e-6, 0.0, 8192)
    plan = cluster_sim.Plan(
        models, cost, Workload(models, 1.1, 30.0), 1, None, 1.0, float("inf"), 1.0, 5.0, 3.0, 0.75, 0
    )

    async def main():
        cluster = {"heartbeat_s": 0.5, "worker_ttl_s": 3.0}
        async with cluster_sim.SimCluster(split, COSTS, [cost] * 4, plan, cluster, Catalog.load()) as sim:
            loaded = [d.resident_models for d in sim.devices]
            results = await asyncio.gather(*(sim.call(c) for c in calls), return_exceptions=True)
            served = [sorted(m.id for m in d.models()) for d in sim.devices]
            return loaded, results, served, sim.bus.counts["redelivered"]

    loaded, results, served, redelivered = run_virtual(main())
    # One model loaded each at start, spread over each pool's own models in turn.
    assert sorted(loaded) == [["sim/a"], ["sim/a"], ["sim/b"], ["sim/c"]]
    assert [type(r).__name__ for r in results] == ["EncodeResult"] * 80
    assert sorted(served) == [["sim/a", "sim/c"]] * 3 + [["sim/b", "sim/d"]]  # Zipf 1.1: a and c take 0.65 of the calls
    assert redelivered == 0
