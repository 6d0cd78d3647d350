"""A thousand workers, simulated: shoal's own gateway and workers over a simulated JetStream and
simulated devices, in virtual time, so fleets this machine cannot hold run on it.

    load (bench/cluster.py's) ─▶ RemoteService × G ─▶ Bus (sim_jetstream) ─▶ Worker × N ─▶ SimDevice
                                  (the gateways)      streams, consumers   Puller, HostQueue (real)

The policy code is the real one, unmodified: `RemoteService` publishes and awaits replies, each
`Worker` runs its `Puller`s (pull by room, by affinity, nak of over-pulls), its `HostQueue` and its
device loop; only `protocol.connect` hands them a simulated connection, and their clocks read the
virtual one (virtual_time.py). Devices are bench/cluster.py's `SimDevice` and `Cost`, the load is
its `Workload`, so a run here and a run there differ only in what is simulated. What takes virtual
time: the devices' batches, and the costs of cluster_sim_costs.json (`calibrate` measures them on a
real nats-server and the real gateway here): a stream's single server per store, pull request,
delivery and ack; a gateway's event loop per call and per heartbeat; a worker's per call; a hop's
latency.

Design options, to see what happens when one stream or one gateway is the limit:

    --gateways G        G gateways, the load spread over them in turn (as a load balancer does)
    --pools P           the workers in P pools (worker i in pool i mod P); the gateways send each
                        call to the pool with the most free tokens (directory.pool_of)
    --pool-models X     all: every pool serves every model; split: model i only in pool i mod P,
                        and each pool gets workers in proportion to its models' share of the calls
    --partition X       one: one stream (shoal's SHOAL_WORK); pool: one stream per pool; model: one
                        stream per model (a stream is one server here)
    --host-processes K  the workers share K event loops (bench/cluster.py runs its 16 in one);
                        default: each its own host

    python bench/cluster_sim.py calibrate                      # measure the costs, write the JSON
    python bench/cluster_sim.py --workers 16 --mirror          # bench/cluster.py's 16-worker pull run
    python bench/cluster_sim.py --workers 100,1000,5000        # one gateway, one stream
    python bench/cluster_sim.py --workers 5000 --gateways 16 --pools 8 --partition pool
    python bench/cluster_sim.py --workers 5000 --gateways 16 --pools 8 --partition pool \
        --pool-models split --models 48
    python bench/cluster_sim.py plot docs/img/cluster_sim.svg RUN.json ...   # from --out's

Other options (the device, the load, the knee) are bench/cluster.py's and mean the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import cluster as real  # bench/cluster.py
import sim_jetstream as sj
from shoal.catalog import Catalog
from shoal.cluster import protocol as p
from shoal.cluster.directory import Holders, WorkerDirectory
from shoal.cluster.gateway import RemoteService
from shoal.cluster.worker import Worker
from shoal.config import ClusterSettings, Settings
from shoal.errors import ShoalError
from virtual_time import run_virtual, virtual_clock

COSTS_FILE = Path(__file__).with_name("cluster_sim_costs.json")
PARTITIONS = ("one", "pool", "model")
POOL_CHOICES = ("most-free", "weighted")  # shoal's directory.pool_of; a draw weighted by free tokens
POOL_MODELS = ("all", "split")


@dataclass(frozen=True)
class Costs:
    """What takes virtual time besides the devices (see the module docstring)."""

    bus: sj.BusCosts
    gateway: sj.ClientCosts
    worker: sj.ClientCosts
    source: str = ""

    @classmethod
    def load(cls, path: Path = COSTS_FILE) -> Costs:
        raw = json.loads(path.read_text())
        return cls(
            sj.BusCosts(**raw["bus"]), sj.ClientCosts(**raw["gateway"]), sj.ClientCosts(**raw["worker"]), raw["source"]
        )

    def gateway_call_s(self) -> float:
        return self.gateway.publish_s + self.gateway.receive_s

    def consumer_call_s(self) -> float:
        """A consumer's server time per call: two pull requests (one, then more: it expires),
        its delivery and its ack."""
        b = self.bus
        return 2 * b.fetch_s + b.status_s + b.deliver_s + b.ack_s


@dataclass(frozen=True)
class Design:
    gateways: int = 1
    pools: int = 1
    partition: str = "one"
    host_processes: int = 0  # 0: each worker its own host
    pool_choice: str = "most-free"  # how a gateway picks a model's pool (POOL_CHOICES)
    pool_models: str = "all"  # which models a pool serves (POOL_MODELS)

    def label(self) -> str:
        parts = [f"{self.gateways} gateway{'s' if self.gateways > 1 else ''}"]
        parts.append(
            {"one": "1 stream", "pool": f"{self.pools} pools, a stream each", "model": "a stream per model"}[
                self.partition
            ]
            if self.partition != "one" or self.pools == 1
            else f"{self.pools} pools, 1 stream"
        )
        if self.pools > 1 and self.pool_models == "split":
            parts.append("models split over the pools")
        if self.pools > 1 and self.pool_choice != "most-free":
            parts.append(f"pool by {self.pool_choice}")
        if self.host_processes:
            parts.append(f"{self.host_processes} host process{'es' if self.host_processes > 1 else ''}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Plan:
    """bench/cluster.py's device, load and knee, built from its options as its `main_async` does."""

    model_ids: list[str]
    cost: real.Cost
    workload: real.Workload
    resident: int | None  # models a device holds loaded at most (None: all)
    target_batch_s: float | None
    bound_s: float  # the queries' p99 at the knee
    bulk_bound_s: float  # the bulk calls' (inf: no bulk calls)
    burst: float
    burst_period_s: float
    duration_s: float
    warmup_s: float
    refine: int

    def preload(self, index: int, model_ids: list[str] | None = None) -> tuple[str, ...]:
        """What device `index` (of those serving `model_ids`, default all) has loaded at start:
        `resident` models, spread evenly (the bench's)."""
        model_ids = self.model_ids if model_ids is None else model_ids
        n, k = len(model_ids), self.resident or 0
        return tuple(model_ids[(index * k + j) % n] for j in range(min(k, n)))


def pools_of(
    design: Design, model_ids: list[str], shares: list[float], num_workers: int
) -> tuple[list[int], list[list[str]]]:
    """(each worker's pool, each pool's models). `all`: worker i in pool i mod P, every pool every
    model. `split`: model i in pool i mod P only, and the workers dealt out in turn to the pool
    furthest below its models' share of the calls (so the slow devices, the last ones, spread too);
    every pool gets one at least."""
    pools = design.pools
    if design.pool_models == "all" or pools == 1:
        return [i % pools for i in range(num_workers)], [list(model_ids)] * pools
    if pools > len(model_ids) or pools > num_workers:
        raise SystemExit(f"--pool-models split: {pools} pools need as many models and workers at least")
    models = [model_ids[j::pools] for j in range(pools)]
    weight = [sum(shares[j::pools]) for j in range(pools)]
    counts, order = [0] * pools, []
    for i in range(num_workers):
        empty = [j for j in range(pools) if not counts[j]]
        left = num_workers - i
        if len(empty) >= left:  # the last workers go to pools still without one
            j = empty[0]
        else:
            j = max(range(pools), key=lambda j: weight[j] * (i + 1) - counts[j])
        counts[j] += 1
        order.append(j)
    return order, models


def plan_of(args: argparse.Namespace) -> Plan:
    model_ids, cost, workload, target_batch_s = real.fleet_of(args)
    high = int(args.bulk_items.split(",")[1])
    waits = [10 * cost.of(round(workload.query_mean_tokens), False)]
    if args.resident and cost.swap_s:
        waits.append(cost.swap_s)
    if args.bulk_share:
        waits.append(target_batch_s or cost.of(cost.max_batch_tokens, False))
    largest_s = cost.of(round(high * 46), False) + cost.batch_s * (high * 46 // cost.max_batch_tokens)
    bulk_bound_s = float("inf")
    if args.bulk_share:
        bulk_bound_s = args.bulk_p99_bound_ms / 1000 if args.bulk_p99_bound_ms else 3 * largest_s
    return Plan(
        model_ids,
        cost,
        workload,
        args.resident,
        target_batch_s,
        args.p99_bound_ms / 1000 if args.p99_bound_ms else sum(waits),
        bulk_bound_s,
        args.burst,
        args.burst_period_s,
        args.duration_s,
        args.warmup_s if args.warmup_s is not None else min(1.0, args.duration_s / 4),
        args.refine,
    )


@dataclass
class SimStep:
    design: str
    workers: int
    rate: float  # requests/s asked for
    offered: float
    achieved: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    failed: int
    busy: float  # devices' modelled useful time (batches, not loads) / window, mean over devices
    bulk_p99_ms: float
    bulk_answered: int
    swaps_per_min: float  # model loads on the whole fleet
    naks_per_s: float
    redelivered: int
    gateway_msgs_per_s: float  # messages a gateway sent and received, mean over gateways
    bus_msgs_per_s: float  # messages into and out of the server
    fetches_per_s: float
    conflicts_per_s: float  # pull requests refused: 409, past the consumer's max_waiting
    stream_busy: float  # the busiest stream's server: work it was given / window (over 1: saturated)
    consumer_busy: float  # the busiest consumer's server
    consumer_calls_busy: float  # ... less what it spent refusing pull requests (409)
    nats_cores: float  # nats-server's CPU / window, at the costs under load
    api_busy: float  # JetStream's API queue
    api_per_s: float
    gateway_busy: float  # the busiest gateway's event loop
    worker_cpu_busy: float  # the busiest worker event loop
    wall_s: float  # what the step took in real time
    ok: bool = False


class SimCluster:
    """N workers and G gateways on one simulated bus (see the module docstring); a context for
    `run_virtual`."""

    def __init__(
        self,
        design: Design,
        costs: Costs,
        device_costs: list[real.Cost],
        plan: Plan,
        cluster: dict[str, Any],
        catalog: Catalog,
        seed: int = 0,
    ) -> None:
        self.design = design
        self.seed = seed
        self.costs = costs
        self.device_costs = device_costs
        self.plan = plan
        self.cluster = cluster
        self.catalog = catalog
        self.workers: list[Worker] = []
        self.devices: list[real.SimDevice] = []
        self.gateways: list[RemoteService] = []
        self.gateway_cpus: list[sj.Server] = []
        self.worker_cpus: list[sj.Server] = []
        self.conns: dict[str, sj.Connection] = {}
        self._runs: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._next = 0
        self._clock: Any = None
        self._connect: Any = None

    async def __aenter__(self) -> SimCluster:
        loop = asyncio.get_running_loop()
        self.bus = sj.Bus(loop, self.costs.bus, partition=self._partition)
        self._connect, p.connect = p.connect, self._sim_connect
        self._clock = virtual_clock(loop)
        self._clock.__enter__()
        self._pool_of = WorkerDirectory.__dict__["pool_of"]  # the staticmethod itself
        if self.design.pool_choice == "weighted":
            WorkerDirectory.pool_of = staticmethod(_weighted_pool(random.Random(1)))  # type: ignore[method-assign]
        shared = [sj.Server(loop, f"host{i}") for i in range(self.design.host_processes)]
        plan = self.plan
        pool_of, pool_models = pools_of(self.design, plan.model_ids, plan.workload.shares, len(self.device_costs))
        in_pool = [0] * len(pool_models)
        for i, cost in enumerate(self.device_costs):
            j = pool_of[i]
            device = real.SimDevice(f"sim{i}", pool_models[j], cost, plan.resident, plan.target_batch_s)
            preload = plan.preload(i if self.design.pool_models == "all" else in_pool[j], pool_models[j])
            in_pool[j] += 1
            settings = ClusterSettings(nats_url="nats://sim:4222", pool=f"pool{j}", **self.cluster)
            self.worker_cpus.append(shared[i % len(shared)] if shared else sj.Server(loop, f"w{i}"))
            worker = Worker([device], settings, devices=[device.name], worker_id=f"w{i}", preload=preload)
            self.devices.append(device)
            self.workers.append(worker)
            self._runs.append(asyncio.create_task(worker.run(self._stop), name=f"worker w{i}"))
        for _ in range(self.design.gateways):
            settings = Settings(cluster=ClusterSettings(nats_url="nats://sim:4222", pool="pool0", **self.cluster))
            gateway = RemoteService(settings, self.catalog)
            await gateway.start()
            self.gateways.append(gateway)
        await self._until_seen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for gateway in self.gateways:
            await gateway.stop()
        self._stop.set()
        await asyncio.wait(self._runs, timeout=30.0)
        for task in self._runs:
            task.cancel()
        p.connect = self._connect
        WorkerDirectory.pool_of = self._pool_of
        self._clock.__exit__(None, None, None)

    async def _until_seen(self) -> None:
        """Until every gateway is connected and sees every worker."""
        n = len(self.workers)
        for _ in range(600):
            if all(g.ready and len(g.workers.live()) >= n for g in self.gateways):
                return
            await asyncio.sleep(0.1)
        raise SystemExit(f"the gateways do not see {n} workers after 60 s of virtual time")

    def _partition(self, subject: str) -> str:
        pool, model = subject.split(".")[2:4]
        return {"one": p.STREAM, "pool": f"{p.STREAM}_{pool}", "model": f"{p.STREAM}_{model}"}[self.design.partition]

    async def _sim_connect(self, settings: ClusterSettings, name: str, **kwargs: Any) -> sj.Connection:
        """`protocol.connect` in the simulation: a gateway's connection gets its own event loop's
        queue, a worker's its host's."""
        kind, _, ident = name.partition(" ")
        if kind == "shoal-worker":
            conn = self.bus.connect(name, self.costs.worker, self.worker_cpus[int(ident[1:])])
        else:
            cpu = sj.Server(self.bus.loop, name)
            self.gateway_cpus.append(cpu)
            conn = self.bus.connect(name, self.costs.gateway, cpu)
        self.conns[ident] = conn
        return conn

    async def kill(self, index: int) -> None:
        """Worker `index` dies at once (kill -9): nothing acked, nothing handed back."""
        worker = self.workers[index]
        self.conns[worker.id].kill()
        doomed = [*worker._tasks, *worker._pulling, *(t for d in worker.devices for t in d.running), self._runs[index]]
        for task in doomed:
            task.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        await self.devices[index].stop()

    async def call(self, call: Any) -> Any:
        """One call through the next gateway (a load balancer's round robin)."""
        self._next = (self._next + 1) % len(self.gateways)
        return await self.gateways[self._next].run(call)

    # --- one step of load -----------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        gateway_conns = [self.conns[g.id] for g in self.gateways if g.id in self.conns]
        return {
            "t": self.bus.loop.time(),
            "wall": time.perf_counter(),
            "busy": np.array([d.busy_s for d in self.devices]),
            "swaps": sum(d.swaps for d in self.devices),
            "tokens": sum(d.tokens for d in self.devices),
            "counts": dict(self.bus.counts),
            "messages": self.bus.message_count(),
            "streams": {name: s.server.busy_s for name, s in self.bus.streams.items()},
            "consumers": {name: c.server.busy_s for name, c in self.bus.consumers.items()},
            "consumers_refused": {name: c.refused_s for name, c in self.bus.consumers.items()},
            "nats_cpu": self.bus.cpu_s(),
            "api": self.bus.api.busy_s,
            "gateway_cpu": [c.busy_s for c in self.gateway_cpus],
            "worker_cpu": {id(c): c.busy_s for c in self.worker_cpus},
            "gateway_msgs": sum(c.sent + c.received for c in gateway_conns),
        }

    async def until_idle(self) -> None:
        """Until no call is in flight (at most 60 s): the next step starts from an empty queue.
        (A consumer's server may stay busy with pull requests for ever: that is not a call.)"""
        for _ in range(600):
            if not any(d.outstanding_tokens for d in self.devices) and not any(g._pending for g in self.gateways):
                return
            await asyncio.sleep(0.1)

    async def step(self, rate: float) -> SimStep:
        """One open-loop step at `rate`, as bench/cluster.py's `Bench._step`: the same seeded
        arrivals (Poisson, with --burst on/off around the rate) and calls; the window is the step
        after its warm-up."""
        loop = asyncio.get_running_loop()
        plan, workload = self.plan, self.plan.workload
        await self.until_idle()
        seed = f"{len(self.workers)} {rate:.3f}" + (
            f" {self.seed}" if self.seed else ""
        )  # 0: bench/cluster.py's arrivals
        rng = random.Random(seed)
        workload.rewind()
        records: list[tuple[float, float, bool, bool]] = []  # (scheduled arrival, answered at, ok, bulk)
        arrivals: list[float] = []
        running: dict[asyncio.Task[None], tuple[float, bool]] = {}
        snapshots: dict[str, dict[str, Any]] = {}

        async def one(call: Any, arrival: float, bulk: bool) -> None:
            try:
                await self.call(call)
                records.append((arrival, loop.time(), True, bulk))
            except ShoalError:
                records.append((arrival, loop.time(), False, bulk))

        async def snapshot(name: str, at: float) -> None:
            await asyncio.sleep(max(0.0, at - loop.time()))
            snapshots[name] = self._snapshot()

        start = loop.time()
        window = (start + plan.warmup_s, start + plan.duration_s)
        snapping = [asyncio.create_task(snapshot("start", window[0])), asyncio.create_task(snapshot("end", window[1]))]
        arrival = start
        while True:
            arrival = real.next_arrival(rng, arrival, start, rate, plan.burst, plan.burst_period_s)
            if arrival > window[1]:
                break
            if arrival > loop.time():
                await asyncio.sleep(arrival - loop.time())
            call = workload.next()
            bulk = real.is_bulk(call)
            task = asyncio.create_task(one(call, arrival, bulk))
            arrivals.append(arrival)
            running[task] = (arrival, bulk)
            task.add_done_callback(lambda t: running.pop(t, None))
        await asyncio.gather(*snapping)
        if running:
            bulk_s = plan.bulk_bound_s if any(bulk for _, bulk in running.values()) else 0.0
            await asyncio.wait(set(running), timeout=max(2.0, 2 * plan.bound_s, bulk_s))
        unfinished = [bulk for arrival, bulk in running.values() if arrival >= window[0]]
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return self._measure(rate, window, arrivals, records, unfinished, snapshots)

    def _measure(self, rate, window, arrivals, records, unfinished, snapshots) -> SimStep:
        """As bench/cluster.py's `Bench._measure`: queries' latency of the calls that arrived in the
        window, the bulk calls' apart; throughput of the answers in it against the arrivals of the
        same span shifted by the median latency."""
        plan = self.plan
        a, b = snapshots["start"], snapshots["end"]
        span = b["t"] - a["t"]
        in_window = [r for r in records if window[0] <= r[0] <= window[1]]
        latencies = [done - arrival for arrival, done, _, bulk in in_window if not bulk]
        latencies += [float("inf")] * unfinished.count(False)
        bulk_latencies = [done - arrival for arrival, done, ok, bulk in in_window if bulk and ok]
        bulk_latencies += [float("inf")] * (unfinished.count(True) + sum(1 for r in in_window if r[3] and not r[2]))
        p50_s = float(np.percentile(latencies, 50, method="higher")) if latencies else float("nan")
        lead = min(p50_s, plan.warmup_s)
        offered = sum(1 for t in arrivals if a["t"] - lead <= t <= b["t"] - lead) / span
        failed = len(unfinished) + sum(1 for r in in_window if not r[2])
        counts = {k: b["counts"].get(k, 0) - a["counts"].get(k, 0) for k in b["counts"]}
        streams = [b["streams"][k] - a["streams"].get(k, 0.0) for k in b["streams"]]
        consumers = [b["consumers"][k] - a["consumers"].get(k, 0.0) for k in b["consumers"]]
        refused = [b["consumers_refused"][k] - a["consumers_refused"].get(k, 0.0) for k in b["consumers"]]
        step = SimStep(
            design=self.design.label(),
            workers=len(self.workers),
            rate=rate,
            offered=offered,
            achieved=sum(1 for _, done, ok, _ in records if ok and a["t"] <= done <= b["t"]) / span,
            tokens_per_s=(b["tokens"] - a["tokens"]) / span,
            p50_ms=p50_s * 1000,
            p99_ms=float(np.percentile(latencies, 99, method="higher")) * 1000 if latencies else float("nan"),
            failed=failed,
            busy=float(np.mean(b["busy"] - a["busy"])) / span,
            bulk_p99_ms=float(np.percentile(bulk_latencies, 99, method="higher")) * 1000
            if bulk_latencies
            else float("nan"),
            bulk_answered=sum(1 for r in in_window if r[3] and r[2]),
            swaps_per_min=(b["swaps"] - a["swaps"]) / span * 60,
            naks_per_s=counts.get("nak", 0) / span,
            redelivered=counts.get("redelivered", 0),
            gateway_msgs_per_s=(b["gateway_msgs"] - a["gateway_msgs"]) / span / len(self.gateways),
            bus_msgs_per_s=(b["messages"] - a["messages"]) / span,
            fetches_per_s=counts.get("fetch", 0) / span,
            conflicts_per_s=counts.get("409", 0) / span,
            stream_busy=max(streams, default=0.0) / span,
            consumer_busy=max(consumers, default=0.0) / span,
            consumer_calls_busy=max((c - r for c, r in zip(consumers, refused)), default=0.0) / span,
            nats_cores=(b["nats_cpu"] - a["nats_cpu"]) / span,
            api_busy=(b["api"] - a["api"]) / span,
            api_per_s=counts.get("api", 0) / span,
            gateway_busy=max(np.subtract(b["gateway_cpu"], a["gateway_cpu"]), default=0.0) / span,
            worker_cpu_busy=max((b["worker_cpu"][k] - a["worker_cpu"][k] for k in b["worker_cpu"]), default=0.0) / span,
            wall_s=b["wall"] - a["wall"],
        )
        step.ok = (
            step.achieved >= 0.95 * offered
            and step.p99_ms <= plan.bound_s * 1000
            and not step.bulk_p99_ms > plan.bulk_bound_s * 1000  # (nan: no bulk call in the window)
            and not failed
        )
        return step


def _weighted_pool(rng: random.Random) -> Any:
    """A pool drawn with odds by its workers' free tokens (directory.pool_of's alternative): every
    gateway sending to the one with the most, from heartbeats a second old, herds the calls."""

    def pool_of(holders: Holders) -> str:
        free: dict[str, int] = {}
        for beat, _ in holders:
            free[beat.pool] = free.get(beat.pool, 0) + beat.free_tokens + 1
        return rng.choices(list(free), weights=list(free.values()))[0]

    return pool_of


# --- the ramp and the report ----------------------------------------------------------------------


def capacity_req_s(design: Design, costs: Costs, num_workers: int, heartbeat_s: float, shares: list[float]) -> float:
    """What the measured costs allow at most, before any device: the gateways' event loops and the
    busiest stream's server (a first guess for the ramp; the simulation says what really holds)."""
    hb_load = num_workers / heartbeat_s * costs.gateway.heartbeat_s  # share of each gateway's loop
    gateways = design.gateways * max(0.0, 1.0 - hb_load) / max(1e-12, costs.gateway_call_s())
    split = design.pool_models == "split" and design.pools > 1
    pool_share = max(sum(shares[j :: design.pools]) for j in range(design.pools)) if split else 1.0 / design.pools
    stream = {"one": 1.0, "pool": pool_share, "model": max(shares)}[design.partition]
    consumer = max(shares) / (1 if split else design.pools)  # a consumer per pool and model
    return min(gateways, 1.0 / (costs.bus.publish_s * stream), 1.0 / (costs.consumer_call_s() * consumer))


async def ramp(cluster: SimCluster, top_req_s: float) -> list[SimStep]:
    """bench/cluster.py's ramp: through RAMP × `top_req_s` until a step fails, then `refine`
    bisections; when the first step fails, halving down to a passing one first."""
    steps: list[SimStep] = []

    async def run(rate: float) -> SimStep:
        steps.append(await cluster.step(rate))
        print(step_line(steps[-1]), flush=True)
        return steps[-1]

    for fraction in real.RAMP:
        if not (await run(fraction * top_req_s)).ok:
            break
    rate = real.RAMP[0] * top_req_s
    while not any(s.ok for s in steps) and rate > 1.0 and len(steps) < 8:
        rate /= 2
        await run(rate)
    for _ in range(cluster.plan.refine):
        passed = [s.rate for s in steps if s.ok]
        failed = [s.rate for s in steps if not s.ok and s.rate > max(passed, default=0.0)]
        if not passed or not failed:
            break
        await run((max(passed) + min(failed)) / 2)
    return steps


def step_line(s: SimStep) -> str:
    return (
        f"  {s.workers:>5}w  rate {s.rate:9.1f}  offered {s.offered:9.1f}  achieved {s.achieved:9.1f} req/s  "
        f"p50 {s.p50_ms:6.0f}  p99 {s.p99_ms:6.0f} ms"
        + (f" (bulk {s.bulk_p99_ms / 1000:.1f} s)" if s.bulk_p99_ms == s.bulk_p99_ms else "")
        + f"  busy {s.busy:4.0%}  loads/min {s.swaps_per_min:5.0f}  failed {s.failed:>5}  "
        f"naks/s {s.naks_per_s:6.0f}  gw {s.gateway_msgs_per_s:8,.0f} msg/s ({s.gateway_busy:4.0%})  bus "
        f"{s.bus_msgs_per_s:9,.0f} msg/s (stream {s.stream_busy:4.0%}, fetch/s {s.fetches_per_s:8,.0f}, "
        f"409/s {s.conflicts_per_s:6,.0f}, consumer {s.consumer_busy:4.0%} ({s.consumer_calls_busy:4.0%} on calls), {s.nats_cores:.2f} cores, api/s {s.api_per_s:6,.0f} ({s.api_busy:4.0%}))  wall {s.wall_s:5.1f} s  {'ok' if s.ok else '--'}"
    )


def knee(steps: list[SimStep]) -> SimStep | None:
    passed = [s for s in steps if s.ok]
    return max(passed, key=lambda s: s.rate) if passed else None


def limit_of(s: SimStep) -> str:
    """What held the knee back: the busiest of the devices, the gateways' loops, the streams and
    the consumers (their work on calls: a 409 storm fills whatever time they have left)."""
    loads = {
        "devices": s.busy,
        "gateway": s.gateway_busy,
        "stream": s.stream_busy,
        "consumer": s.consumer_calls_busy,
        "JetStream API": s.api_busy,
    }
    name = max(loads, key=loads.__getitem__)
    return f"{name} ({loads[name]:.0%} busy)"


def table(rows: list[tuple[int, Design, SimStep | None, float, float]]) -> str:
    lines = [
        f"{'workers':>7}  {'design':<34} {'knee req/s':>10} {'of peak':>7} {'busy':>5} {'p99 ms':>6} "
        f"{'gateway msg/s':>13} {'bus msg/s':>10} {'stream':>6} {'consumer':>8} {'gw loop':>7} {'409/s':>7}  {'limit':<22} {'wall s':>7}"
    ]
    for workers, design, best, peak_req_s, wall_s in rows:
        if best is None:
            lines.append(f"{workers:>7}  {design.label():<34} {'-':>10}  (no step passed)  {wall_s:7.0f}")
            continue
        lines.append(
            f"{workers:>7}  {design.label():<34} {best.achieved:10,.0f} {best.achieved / peak_req_s:7.0%} "
            f"{best.busy:5.0%} {best.p99_ms:6.0f} {best.gateway_msgs_per_s:13,.0f} {best.bus_msgs_per_s:10,.0f} "
            f"{best.stream_busy:6.0%} {best.consumer_calls_busy:8.0%} {best.gateway_busy:7.0%} {best.conflicts_per_s:7,.0f}  {limit_of(best):<22} {wall_s:7.0f}"
        )
    return "\n".join(lines)


async def progress(every_s: float) -> None:
    """A line every `every_s` of virtual time: how fast the simulation runs."""
    loop = asyncio.get_running_loop()
    wall = time.perf_counter()
    while True:
        await asyncio.sleep(every_s)
        now = time.perf_counter()
        print(
            f"    [virtual {loop.time():7.1f} s, {now - wall:5.1f} s of wall time for the last {every_s:g}]", flush=True
        )
        wall = now


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's options, bench/cluster.py's for the device and the load)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", default="100,1000,5000", help="worker counts, comma-separated")
    ap.add_argument("--gateways", type=int, default=1)
    ap.add_argument("--pools", type=int, default=1)
    ap.add_argument("--partition", choices=PARTITIONS, default="one")
    ap.add_argument(
        "--dispatcher", choices=("pull", "pull-any"), default="pull", help="pull-any: without model affinity"
    )
    ap.add_argument("--pool-choice", choices=POOL_CHOICES, default="most-free", help="how a gateway picks a pool")
    ap.add_argument("--pool-models", choices=POOL_MODELS, default="all", help="which models a pool serves")
    ap.add_argument("--host-processes", type=int, default=0, help="workers share this many event loops (0: own hosts)")
    ap.add_argument(
        "--mirror", action="store_true", help="as bench/cluster.py runs: one host process, heartbeats every 0.5 s"
    )
    ap.add_argument("--heartbeat-s", type=float, help="ClusterSettings.heartbeat_s (default shoal's; --mirror: 0.5)")
    ap.add_argument("--costs", type=Path, default=COSTS_FILE, help="the measured costs (calibrate writes them)")
    ap.add_argument(
        "--worker-call-us",
        type=float,
        help="a worker's CPU per call instead of the costs' (e.g. what a bench/cluster.py run measured: cpu h / req/s)",
    )
    ap.add_argument(
        "--top-req-s",
        type=float,
        help="the ramp's 100 %% (default: the lower of the fleet's peak and capacity_req_s x 1.2)",
    )
    ap.add_argument("--rates", help="run these rates (req/s, comma-separated) instead of the ramp")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the arrivals' and the pullers' jitter's seed (0: bench/cluster.py's arrivals; others show the spread)",
    )
    ap.add_argument("--out", type=Path, help="write every step as JSON here")
    ap.add_argument("--progress-s", type=float, help="print the simulation's speed every this many virtual seconds")
    ours, rest = ap.parse_known_args(argv)
    bench = real.parse_args(rest + ["--workers", ours.workers])
    return ours, bench


async def main_async(ours: argparse.Namespace, args: argparse.Namespace) -> int:
    real.quiet()
    logging.getLogger("shoal").setLevel(logging.ERROR)
    random.seed(ours.seed)  # the pullers' jitter: every run with a seed the same
    costs = Costs.load(ours.costs)
    if ours.worker_call_us is not None:
        costs = replace(costs, worker=replace(costs.worker, pulled_s=ours.worker_call_us / 1e6))
    plan = plan_of(args)
    cost, workload = plan.cost, plan.workload
    heartbeat_s = ours.heartbeat_s or (0.5 if ours.mirror else ClusterSettings().heartbeat_s)
    cluster: dict[str, Any] = {"heartbeat_s": heartbeat_s, "worker_ttl_s": max(3.0, 5 * heartbeat_s)}
    if ours.mirror:
        cluster["worker_ttl_s"] = 3.0
    cluster["model_affinity"] = ours.dispatcher == "pull"
    if args.prefetch_s is not None:
        cluster["prefetch_s"] = args.prefetch_s
    if args.min_inflight_tokens is not None:
        cluster["min_inflight_tokens"] = args.min_inflight_tokens
    if args.cold_pull_after_s is not None:
        cluster["cold_pull_after_s"] = args.cold_pull_after_s
    elif args.resident and args.swap_ms:  # as bench/cluster.py: an operator sets it to the load's time
        cluster["cold_pull_after_s"] = args.swap_ms / 1000 * args.slowdown
    design = Design(
        ours.gateways,
        ours.pools,
        ours.partition,
        1 if ours.mirror else ours.host_processes,
        ours.pool_choice,
        ours.pool_models,
    )
    catalog = Catalog.load()
    print("shoal cluster simulation: real gateways and workers, simulated JetStream and devices, in virtual time")
    print(f"costs:       {ours.costs.name} ({costs.source})")
    print(
        f"             stream: publish {costs.bus.publish_s * 1e6:.1f} us; consumer: pull request {costs.bus.fetch_s * 1e6:.1f}, "
        f"its expiry {costs.bus.status_s * 1e6:.1f}, "
        f"delivery {costs.bus.deliver_s * 1e6:.1f}, ack {costs.bus.ack_s * 1e6:.1f}; hop {costs.bus.latency_s * 1e6:.0f} us; "
        f"gateway: {costs.gateway_call_s() * 1e6:.0f} us a call, {costs.gateway.heartbeat_s * 1e6:.0f} a heartbeat; "
        f"worker: {costs.worker.pulled_s * 1e6:.0f} us a call"
    )
    resident = (
        f"{plan.resident} of {args.models} models loaded at most, a load {cost.swap_s * 1000:g} ms"
        if plan.resident
        else "every model loaded"
    )
    print(
        f"device:      {cost.batch_s * 1000:g} ms + {cost.token_s * 1e6:g} us/token a batch, peak "
        f"{cost.peak_tokens_per_s:,.0f} tokens/s; {resident}\n"
        f"load:        {workload.mean_tokens:.0f} tokens a call over {args.models} models"
        + (f", {args.bulk_share:.1%} bulk" if args.bulk_share else "")
        + (
            f", bursts {args.burst:g}x / {2 - args.burst:g}x the rate, {args.burst_period_s:g} s each"
            if args.burst != 1
            else ""
        )
        + f"\nknee:        queries' p99 <= {plan.bound_s * 1000:.0f} ms"
        + (f", bulk p99 <= {plan.bulk_bound_s:.0f} s" if args.bulk_share else "")
        + f", >= 95 % answered, none failed; {args.duration_s:g} s steps; {ours.dispatcher}"
    )
    print(f"design:      {design.label()}; heartbeats every {heartbeat_s:g} s\n", flush=True)
    rows, all_steps = [], []
    for num_workers in [int(n) for n in args.workers.split(",")]:
        costs_list = real.device_costs(cost, num_workers, args)
        peak_req_s = sum(c.peak_tokens_per_s for c in costs_list) / workload.mean_tokens
        cap = capacity_req_s(design, costs, num_workers, heartbeat_s, workload.shares)
        top = ours.top_req_s or min(peak_req_s, 1.2 * cap)
        print(
            f"{num_workers} workers: fleet peak {peak_req_s:,.0f} req/s, the costs allow {cap:,.0f}; ramp to {top:,.0f}",
            flush=True,
        )
        started = time.perf_counter()
        ticker = asyncio.create_task(progress(ours.progress_s)) if ours.progress_s else None
        async with SimCluster(design, costs, costs_list, plan, cluster, catalog, ours.seed) as sim:
            print(
                f"  started: {asyncio.get_running_loop().time():.1f} s of virtual time, {time.perf_counter() - started:.0f} s of wall time",
                flush=True,
            )
            if ours.rates:
                steps = [await sim.step(float(r)) for r in ours.rates.split(",")]
                for s in steps:
                    print(step_line(s), flush=True)
            else:
                steps = await ramp(sim, top)
            if ours.out:  # before the fleet stops: thousands of workers draining take long
                ours.out.write_text(
                    json.dumps(all_steps + [asdict(s) | {"peak_req_s": peak_req_s} for s in steps], indent=1)
                )
        if ticker is not None:
            ticker.cancel()
        wall_s = time.perf_counter() - started
        rows.append((num_workers, design, knee(steps), peak_req_s, wall_s))
        all_steps += [asdict(s) | {"peak_req_s": peak_req_s, "run_wall_s": wall_s} for s in steps]
        print(f"  ({wall_s:.0f} s of wall time)\n", flush=True)
        if ours.out:  # after each fleet: a long run cut short keeps what it has
            ours.out.write_text(json.dumps(all_steps, indent=1))
    print(table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        import sim_calibrate

        return sim_calibrate.main(argv[1:])
    if argv[:1] == ["plot"]:
        import sim_plot

        return sim_plot.main(argv[1:])
    return run_virtual(main_async(*parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
