"""Cluster: workers pulling from a central queue, against top-down routers that push to workers.

The claim under test (DESIGN §5): with many small requests, a central queue that workers pull
from keeps devices busy where a router that pushes each request into a worker's own queue leaves
them idle and loses throughput. Same simulated devices, same load (the same seeded arrivals and
calls), same run; the dispatchers:

    pull         shoal's real path: `RemoteService` (the gateway) publishes each call to the
                 JetStream work queue of a real nats-server; one real `Worker` per device pulls
                 what its free capacity predicts, by model affinity, and feeds its device.
    pull-any     the same with --no-model-affinity: every model pulled alike.
    round-robin  a router that sends each call to the next worker in turn over the same NATS (core
                 request/reply, one subject per worker: no JetStream, no acks); each device
                 batches only what is in its own queue.
    ll-report    the same router, to the worker with the least outstanding tokens in the load
                 reports the workers publish every --report-ms (ties: any of them).
    ll-fresh     the same, from the router's own count of tokens sent and not yet answered (exact
                 with one router: the best case of a push router that ignores models).
    ll-model     ll-fresh plus a load's device time (in tokens) on every worker whose last report
                 does not list the call's model as loaded and that has no call of it out: exact
                 least-loaded push that knows what loads cost.

The devices are bench/cluster_fleet.py's `SimDevice`s (the engine's own scheduler, at most
--resident models loaded, a load costing --swap-ms), all times --slowdown. The slowdown is there
because this harness runs up to 16 devices, 16 Workers, a gateway, NATS and the load generator on
2 cores: devices are slowed until the harness keeps up. Utilization and ratios carry over; req/s
scale with 1/slowdown, latencies with slowdown (but shoal's own time constants, e.g. the 50 ms nak
delay, do not). A call's tokens are the gateway's estimate, so every router knows them exactly.
--slow-share makes some devices --slow-factor times slower (their loads take as long). A device
reports its measured tokens/s through `capacity()`, which the real Worker sizes pulls by, and what
it has loaded through `model(id).loaded`, which the Worker's affinity reads. Each device starts
with --resident models loaded, spread evenly over the models.

Load: open-loop Poisson arrivals (with --burst, on/off modulated) of encode calls: queries of 1-8
texts of 4-48 words and, with --bulk-share, bulk calls of up to --bulk-items texts, over --models
ids of Zipf popularity; latency runs from each call's scheduled arrival. For each dispatcher and
worker count the rate ramps through fractions of the fleet's peak (`RAMP`) until a step fails
(halving from the first step while it fails), then bisects --refine times; the knee is the highest
passing step: answers >= 95 % of arrivals, the queries' p99 <= the bound (default 10x a lone mean
query's device time, plus a load with --resident, plus a time-cut batch with bulk calls), the bulk
calls' p99 <= their bound, no call failed. Each step's line ends in `!` when the harness may have
limited it: a process near a full core, the machine near both, or an event loop late by over a
tenth of the bound.

Processes: this one runs nats-server (a child), the load, and the gateway or router; the devices
(with their Workers) run in a second Python process, so one event loop never carries both ends.

    python bench/cluster.py                 # 4, 8, 16 workers, then the gateway limit (~11 min)
    python bench/cluster.py --quick         # 4 workers, short steps (< 2 min)
    python bench/cluster.py --mix           # issue 38's mix: 16 workers, five dispatchers (~40 min)

(One file over 500 lines: the device host, four routers and the harness belong to one measurement
and are read together; the devices and the load are bench/cluster_fleet.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import msgspec
import numpy as np

from cluster_fleet import Cost, SimDevice, Workload, is_bulk  # Cost, SimDevice, Workload: also bench/cluster_sim.py's
from shoal import calls
from shoal.calls import ErrorResult
from shoal.catalog import Catalog
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port, start_nats
from shoal.config import ClusterSettings
from shoal.errors import ShoalError
from shoal.metrics import Metrics
from shoal.verbs import estimate_tokens
from spawn import machine_line

__all__ = ["RAMP", "Cost", "SimDevice", "Workload", "main", "parse_args", "quiet"]

DISPATCHERS = ("pull", "round-robin", "ll-report", "ll-fresh")
MORE_DISPATCHERS = ("pull-any", "ll-model")  # pull without model affinity; least-loaded push that weighs loads
MIX_DISPATCHERS = "pull,pull-any,round-robin,ll-fresh,ll-model"
# Ramp steps, as fractions of the fleet's peak requests/s; then --refine bisections at the knee.
RAMP = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
HARNESS_CPU = 0.9  # a process above this many cores, or the machine above this share, limits the harness


# --- the harness's own clock ---------------------------------------------------------------------


class LagMonitor:
    """How late the event loop wakes a 10 ms sleep: the harness's own overload, in seconds."""

    INTERVAL_S = 0.01

    def __init__(self) -> None:
        self._lags: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="lag monitor")

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.INTERVAL_S)
            self._lags.append(loop.time() - started - self.INTERVAL_S)

    def take(self) -> float:
        """The p99 lag since the last take."""
        lags, self._lags = self._lags, []
        return float(np.percentile(lags, 99)) if lags else 0.0


def quiet() -> None:
    """Keep the output to the figures: NATS connections closing at each teardown are not news, nor
    is nats-py's drain cancelling its own futures."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("shoal.cluster").setLevel(logging.ERROR)

    def on_error(loop, context) -> None:
        if not isinstance(context.get("exception"), asyncio.CancelledError):
            loop.default_exception_handler(context)

    asyncio.get_running_loop().set_exception_handler(on_error)


# --- the device host (a second process) ---------------------------------------------------------


@dataclass(frozen=True)
class HostSpec:
    nats_url: str
    tag: str  # the pool of its Workers and the prefix of its push subjects
    mode: str  # pull or push
    devices: range  # the indices of the devices it runs
    model_ids: tuple[str, ...]
    costs: tuple[Cost, ...]  # of each of its devices
    report_s: float
    cluster: dict  # ClusterSettings fields
    resident: int | None = None  # models a device holds loaded at most (None: all)
    preload: tuple[tuple[str, ...], ...] = ()  # what each of its devices has loaded at start
    target_batch_s: float | None = None


def ctl_subject(tag: str, host: int) -> str:
    return f"bench.{tag}.ctl.{host}"


def push_subject(tag: str, device: int) -> str:
    return f"bench.{tag}.push.{device}"


def load_subject(tag: str) -> str:
    return f"bench.{tag}.load"


def host_main(spec: HostSpec, index: int) -> None:
    asyncio.run(_host(spec, index))


async def _host(spec: HostSpec, index: int) -> None:
    """Runs its devices until the front asks it to stop; answers `stats` with its counters."""
    from shoal.cluster.worker import Worker

    quiet()
    nc = await p.connect(ClusterSettings(nats_url=spec.nats_url), f"bench-host {spec.tag}.{index}")
    devices = [
        SimDevice(f"sim{i}", list(spec.model_ids), cost, spec.resident, spec.target_batch_s)
        for i, cost in zip(spec.devices, spec.costs)
    ]
    preload = list(spec.preload) or [()] * len(devices)
    lag = LagMonitor()
    lag.start()
    stop, done = asyncio.Event(), asyncio.Event()
    workers: list = []
    running: set[asyncio.Task] = set()  # push calls in flight (held, so they are not collected)
    if spec.mode == "pull":
        settings = ClusterSettings(nats_url=spec.nats_url, pool=spec.tag, **spec.cluster)
        workers = [
            Worker(
                [device],
                settings,
                devices=[device.name],
                metrics=Metrics(),
                worker_id=f"{spec.tag}-{device.name}",
                preload=models,
            )
            for device, models in zip(devices, preload)
        ]
        tasks = [asyncio.create_task(worker.run(stop)) for worker in workers]
    else:
        for i, device, models in zip(spec.devices, devices, preload):
            await device.start()
            await device.warm(list(models))
            await nc.subscribe(push_subject(spec.tag, i), cb=_push_handler(device, running))
        tasks = [
            asyncio.create_task(_report_load(nc, spec, i, device, stop)) for i, device in zip(spec.devices, devices)
        ]

    def naks() -> float:
        return sum(
            sample.value
            for worker in workers
            for family in worker.metrics.registry.collect()
            for sample in family.samples
            if sample.name == "shoal_worker_naks_total"
        )

    async def on_ctl(msg) -> None:
        if msg.data == b"stop":
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for device in devices:
                await device.stop()
            await msg.respond(b"stopped")
            done.set()
            return
        stats = {
            "started": sum(w.started.is_set() for w in workers) if workers else len(devices),
            "cpu_s": time.process_time(),
            "lag_s": lag.take(),
            "naks": naks(),
            "busy_s": [d.busy_s for d in devices],
            "overslept_s": [d.overslept_s for d in devices],
            "tokens": [d.tokens for d in devices],
            "swaps": [d.swaps for d in devices],
            "swap_s": [d.swap_s for d in devices],
            "outstanding": [d.outstanding_tokens for d in devices],
        }
        await msg.respond(msgspec.msgpack.encode(stats))

    await nc.subscribe(ctl_subject(spec.tag, index), cb=on_ctl)
    await done.wait()
    await nc.drain()


def _push_handler(device: SimDevice, running: set):
    async def on_call(msg) -> None:  # nats-py awaits each callback in turn: each call runs in its own task
        task = asyncio.get_running_loop().create_task(_serve_push(device, msg))
        running.add(task)
        task.add_done_callback(running.discard)

    return on_call


async def _serve_push(device: SimDevice, msg) -> None:
    call = calls.decode_call(msg.data)
    try:
        result = await device.run(call)
    except ShoalError as exc:
        result = ErrorResult.of(exc, call.request_id)
    await msg.respond(calls.encode(result))


async def _report_load(nc, spec: HostSpec, index: int, device: SimDevice, stop: asyncio.Event) -> None:
    """The device's outstanding tokens and loaded models every `report_s`, from a random phase (as
    independent workers)."""
    await asyncio.sleep(random.random() * spec.report_s)
    while not stop.is_set():
        report = (index, device.outstanding_tokens, device.resident_models)
        await nc.publish(load_subject(spec.tag), msgspec.msgpack.encode(report))
        await asyncio.sleep(spec.report_s)


# --- dispatchers (in this process) --------------------------------------------------------------


class PullDispatcher:
    """shoal's gateway over the JetStream work queue."""

    def __init__(self, nats_url: str, tag: str, cluster: dict) -> None:
        from shoal.cluster.gateway import RemoteService
        from shoal.config import ClusterSettings, Settings

        self.tag = tag
        self.gateway = RemoteService(
            Settings(cluster=ClusterSettings(nats_url=nats_url, pool=tag, **cluster)), Catalog.load()
        )

    async def start(self, num_workers: int) -> None:
        await self.gateway.start()
        deadline = time.monotonic() + 60.0
        registry = self.gateway.metrics.registry
        while (
            not self.gateway.ready
            or (registry.get_sample_value("shoal_gateway_workers", {"pool": self.tag}) or 0) < num_workers
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway does not see {num_workers} workers after 60 s")
            await asyncio.sleep(0.1)

    async def run(self, call):
        return await self.gateway.run(call)

    async def stop(self) -> None:
        await self.gateway.stop()


class PushDispatcher:
    """A top-down router: one subject per worker, core NATS request/reply. ll-model weighs each
    worker's exact outstanding tokens plus `swap_tokens` (a load's device time, in tokens) where the
    call's model is neither in its last report's loaded models nor among the calls it has out."""

    def __init__(self, nc, tag: str, num_workers: int, policy: str, swap_tokens: float = 0.0) -> None:
        self.nc, self.tag, self.policy, self.swap_tokens = nc, tag, policy, swap_tokens
        self._next = 0
        self._sent_tokens = [0] * num_workers  # sent and not yet answered (ll-fresh, ll-model)
        self._sent_models: list[collections.Counter[str]] = [collections.Counter() for _ in range(num_workers)]
        self._reported = [0] * num_workers  # each worker's last load report (ll-report)
        self._resident: list[set[str]] = [set() for _ in range(num_workers)]  # ... its loaded models (ll-model)
        self._sub = None

    async def start(self, num_workers: int) -> None:
        if self.policy in ("ll-report", "ll-model"):
            self._sub = await self.nc.subscribe(load_subject(self.tag), cb=self._on_report)

    async def _on_report(self, msg) -> None:
        index, tokens, resident = msgspec.msgpack.decode(msg.data)
        self._reported[index] = tokens
        self._resident[index] = set(resident)

    def _choose(self, model_id: str) -> int:
        if self.policy == "round-robin":
            self._next = (self._next + 1) % len(self._sent_tokens)
            return self._next
        if self.policy == "ll-model":
            loads = [
                sent + (0 if model_id in resident or models[model_id] else self.swap_tokens)
                for sent, resident, models in zip(self._sent_tokens, self._resident, self._sent_models)
            ]
        else:
            loads = self._reported if self.policy == "ll-report" else self._sent_tokens
        least = min(loads)
        return random.choice([i for i, load in enumerate(loads) if load == least])

    async def run(self, call):
        index = self._choose(call.model)
        tokens = estimate_tokens(call, None)
        self._sent_tokens[index] += tokens
        self._sent_models[index][call.model] += 1
        try:
            msg = await self.nc.request(push_subject(self.tag, index), calls.encode(call), timeout=call.timeout_s)
        finally:
            self._sent_tokens[index] -= tokens
            self._sent_models[index][call.model] -= 1
        result = calls.decode_result(msg.data)
        if isinstance(result, ErrorResult):
            raise result.error()
        return result

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


# --- load and measurement -----------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (nats-server)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, every process on it included."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return float(sum(values) - idle), float(sum(values))


@dataclass
class Step:
    dispatcher: str
    workers: int
    rate: float  # requests/s asked for
    offered: float  # requests/s that arrived (the Poisson draw), over the window shifted by the p50
    achieved: float  # requests/s answered in the window
    tokens_per_s: float  # run by the devices in the window
    p50_ms: float
    p99_ms: float
    failed: int  # errors, and calls still unanswered twice the bound after the step
    busy: float  # mean over devices of modelled busy seconds / window seconds
    overslept: float  # the share of device time the host's event loop added beyond the model
    naks: int
    cpu_front: float  # cores used by this process
    cpu_host: float  # ... by the busiest device host
    cpu_nats: float
    cpu_machine: float  # the share of both cores in use, by anything
    lag_front_ms: float  # p99 event-loop lateness
    lag_host_ms: float
    ok: bool = False
    harness: bool = False
    # With bulk calls, p50_ms and p99_ms are the queries' (1-8 texts); the bulk calls' apart.
    bulk_p99_ms: float = float("nan")
    bulk_answered: int = 0  # bulk calls that arrived in the window and were answered
    swaps_per_min: float = 0.0  # model loads on the whole fleet, per minute of the window
    swap_share: float = 0.0  # mean over devices of load seconds / window seconds (busy, not useful)


class Bench:
    """One nats-server and this process's NATS connection; hosts and dispatchers per configuration."""

    def __init__(self, args, workload: Workload, model_ids: list[str]) -> None:
        self.args, self.workload, self.model_ids = args, workload, model_ids
        self.cluster: dict = {"heartbeat_s": 0.5, "worker_ttl_s": 3.0}
        if args.prefetch_s is not None:
            self.cluster["prefetch_s"] = args.prefetch_s
        if args.min_inflight_tokens is not None:
            self.cluster["min_inflight_tokens"] = args.min_inflight_tokens
        if args.cold_pull_after_s is not None:
            self.cluster["cold_pull_after_s"] = args.cold_pull_after_s
        elif args.resident and args.swap_ms:
            self.cluster["cold_pull_after_s"] = args.swap_ms / 1000 * args.slowdown
        self.warmup_s = args.warmup_s if args.warmup_s is not None else min(1.0, args.duration_s / 4)
        self.runs = 0
        # Set by main: the bulk calls' p99 bound, a load in tokens (ll-model), the engine's batch cut.
        self.bulk_bound_s = float("inf")
        self.swap_tokens = 0.0
        self.target_batch_s: float | None = None

    async def __aenter__(self):
        quiet()
        self.store = Path(tempfile.mkdtemp(prefix="shoal-bench-nats-"))
        port = free_port()
        self.nats = start_nats(port, self.store)
        self.url = f"nats://127.0.0.1:{port}"
        self.nc = await p.connect(ClusterSettings(nats_url=self.url), "bench-front")
        self.lag = LagMonitor()
        self.lag.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.drain()
        self.nats.terminate()
        self.nats.wait(10)
        shutil.rmtree(self.store, ignore_errors=True)

    async def config(
        self, dispatcher: str, costs: list[Cost], rates: list[float], bound_s: float, num_hosts: int = 1
    ) -> list[Step]:
        """Start the hosts (a device per cost) and the dispatcher; ramp through `rates` until a step
        fails, bisect; stop them."""
        self.runs += 1
        num_workers = len(costs)
        tag = f"r{self.runs}-{dispatcher.replace('+', '-')}-{num_workers}"
        mode = "pull" if dispatcher.startswith("pull") else "push"
        cluster = {**self.cluster, "model_affinity": dispatcher != "pull-any"}
        ctx = multiprocessing.get_context("spawn")
        hosts = []
        resident = self.args.resident
        # Each device starts with `resident` models loaded, spread evenly: the same for every dispatcher.
        preload = [
            tuple(self.model_ids[(i * resident + j) % len(self.model_ids)] for j in range(resident)) if resident else ()
            for i in range(num_workers)
        ]
        for index, share in enumerate(np.array_split(np.arange(num_workers), num_hosts)):
            devices = range(int(share[0]), int(share[-1]) + 1)
            spec = HostSpec(
                self.url,
                tag,
                mode,
                devices,
                tuple(self.model_ids),
                tuple(costs[i] for i in devices),
                self.args.report_ms / 1000.0,
                cluster,
                resident,
                tuple(preload[i] for i in devices),
                self.target_batch_s,
            )
            hosts.append(ctx.Process(target=host_main, args=(spec, index), daemon=True))
            hosts[-1].start()
        front = (
            PullDispatcher(self.url, tag, cluster)
            if mode == "pull"
            else PushDispatcher(self.nc, tag, num_workers, dispatcher, self.swap_tokens)
        )
        try:
            await self._wait_hosts(tag, hosts, num_workers)
            await front.start(num_workers)
            steps: list[Step] = []
            for rate in rates:
                steps.append(await self._step(front, dispatcher, num_workers, tag, hosts, rate, bound_s))
                if not steps[-1].ok:
                    break
            rate = rates[0]
            while not any(s.ok for s in steps) and len(steps) < 4:  # the first step failed: halve, down to a pass
                rate /= 2
                steps.append(await self._step(front, dispatcher, num_workers, tag, hosts, rate, bound_s))
            for _ in range(self.args.refine):  # between the last passing and the first failing step
                passed = [s.rate for s in steps if s.ok]
                failed = [s.rate for s in steps if not s.ok and s.rate > max(passed, default=0.0)]
                if not passed or not failed:
                    break
                steps.append(
                    await self._step(
                        front, dispatcher, num_workers, tag, hosts, (max(passed) + min(failed)) / 2, bound_s
                    )
                )
        finally:
            await front.stop()
            for index, process in enumerate(hosts):
                try:
                    await self.nc.request(ctl_subject(tag, index), b"stop", timeout=30.0)
                except Exception:
                    process.terminate()
                process.join(10)
        return steps

    async def _stats(self, tag: str, hosts: list) -> list[dict]:
        replies = await asyncio.gather(
            *(self.nc.request(ctl_subject(tag, i), b"stats", timeout=5.0) for i in range(len(hosts)))
        )
        return [msgspec.msgpack.decode(r.data) for r in replies]

    async def _wait_hosts(self, tag: str, hosts: list, num_workers: int) -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if not all(process.is_alive() for process in hosts):
                raise SystemExit(f"a device host of {tag} exited (its error is above)")
            try:
                if sum(s["started"] for s in await self._stats(tag, hosts)) == num_workers:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.2)
        raise SystemExit(f"the device hosts of {tag} did not start in 60 s")

    async def _until_idle(self, tag: str, hosts: list) -> None:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and any(any(s["outstanding"]) for s in await self._stats(tag, hosts)):
            await asyncio.sleep(0.1)

    async def _step(self, front, dispatcher, num_workers, tag, hosts, rate, bound_s) -> Step:
        """One open-loop Poisson step at `rate` (with --burst, on/off modulated around it); the
        window is the step after its warm-up."""
        loop = asyncio.get_running_loop()
        await self._until_idle(tag, hosts)
        rng = random.Random(f"{num_workers} {rate:.3f}")  # every dispatcher gets the same arrivals and calls
        self.workload.rewind()
        records: list[tuple[float, float, bool, bool]] = []  # (scheduled arrival, answered at, ok, bulk)
        arrivals: list[float] = []
        running: dict[asyncio.Task, tuple[float, bool]] = {}  # -> its scheduled arrival, bulk
        snapshots: dict[str, tuple] = {}

        async def one(call, arrival: float, bulk: bool) -> None:
            try:
                await front.run(call)
                records.append((arrival, loop.time(), True, bulk))
            except ShoalError:
                records.append((arrival, loop.time(), False, bulk))

        async def snapshot(name: str, at: float) -> None:  # each take() also restarts the lag windows
            await asyncio.sleep(max(0.0, at - loop.time()))
            snapshots[name] = (
                loop.time(),
                await self._stats(tag, hosts),
                time.process_time(),
                proc_cpu_s(self.nats.pid),
                machine_cpu(),
                self.lag.take(),
            )

        start = loop.time()
        window = (start + self.warmup_s, start + self.args.duration_s)
        snapping = [asyncio.create_task(snapshot("start", window[0])), asyncio.create_task(snapshot("end", window[1]))]
        arrival = start
        while True:
            arrival = next_arrival(rng, arrival, start, rate, self.args.burst, self.args.burst_period_s)
            if arrival > window[1]:
                break
            if arrival > loop.time():
                await asyncio.sleep(arrival - loop.time())
            call = self.workload.next()
            task = asyncio.create_task(one(call, arrival, is_bulk(call)))
            arrivals.append(arrival)
            running[task] = (arrival, is_bulk(call))
            task.add_done_callback(lambda t: running.pop(t, None))
        await asyncio.gather(*snapping)
        if running:
            bulk_s = self.bulk_bound_s if any(bulk for _, bulk in running.values()) else 0.0
            await asyncio.wait(set(running), timeout=max(2.0, 2 * bound_s, bulk_s))
        unfinished = [bulk for arrival, bulk in running.values() if arrival >= window[0]]
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        step = self._measure(dispatcher, num_workers, rate, window, arrivals, records, unfinished, snapshots, bound_s)
        print(step_line(step), flush=True)
        return step

    def _measure(
        self, dispatcher, num_workers, rate, window, arrivals, records, unfinished, snapshots, bound_s
    ) -> Step:
        """Latency of the calls that arrived in the window; throughput of the answers in it, against
        the arrivals of the same span shifted by the median latency (so the edges cancel)."""
        (t0, hosts0, front0, nats0, mach0, _), (t1, hosts1, front1, nats1, mach1, lag_front) = (
            snapshots["start"],
            snapshots["end"],
        )
        span = t1 - t0
        in_window = [r for r in records if window[0] <= r[0] <= window[1]]
        # Unanswered calls count as infinitely late ("higher": no interpolation, so inf, not nan).
        latencies = [done - arrival for arrival, done, _, bulk in in_window if not bulk]
        latencies += [float("inf")] * unfinished.count(False)
        bulk_latencies = [done - arrival for arrival, done, ok, bulk in in_window if bulk and ok]
        bulk_latencies += [float("inf")] * (unfinished.count(True) + sum(1 for r in in_window if r[3] and not r[2]))
        p50_s = float(np.percentile(latencies, 50, method="higher")) if latencies else float("nan")
        lead = min(p50_s, self.warmup_s)  # a p50 beyond the warm-up fails the step on p99 anyway
        offered = sum(1 for a in arrivals if t0 - lead <= a <= t1 - lead) / span
        failed = len(unfinished) + sum(1 for r in in_window if not r[2])

        def per_device(key: str) -> np.ndarray:
            return np.concatenate([np.subtract(b[key], a[key]) for a, b in zip(hosts0, hosts1)])

        busy, overslept = per_device("busy_s"), per_device("overslept_s")
        step = Step(
            dispatcher=dispatcher,
            workers=num_workers,
            rate=rate,
            offered=offered,
            achieved=sum(1 for _, done, ok, _ in records if ok and t0 <= done <= t1) / span,
            tokens_per_s=float(per_device("tokens").sum()) / span,
            p50_ms=p50_s * 1000,
            p99_ms=float(np.percentile(latencies, 99, method="higher")) * 1000 if latencies else float("nan"),
            failed=failed,
            busy=float(np.mean(busy)) / span,
            overslept=float(overslept.sum() / max(1e-9, (busy + overslept).sum())),
            naks=int(sum(b["naks"] - a["naks"] for a, b in zip(hosts0, hosts1))),
            cpu_front=(front1 - front0) / span,
            cpu_host=max((b["cpu_s"] - a["cpu_s"]) / span for a, b in zip(hosts0, hosts1)),
            cpu_nats=(nats1 - nats0) / span,
            cpu_machine=(mach1[0] - mach0[0]) / max(1.0, mach1[1] - mach0[1]),
            lag_front_ms=lag_front * 1000,
            lag_host_ms=max(b["lag_s"] for b in hosts1) * 1000,
            bulk_p99_ms=float(np.percentile(bulk_latencies, 99, method="higher")) * 1000
            if bulk_latencies
            else float("nan"),
            bulk_answered=sum(1 for r in in_window if r[3] and r[2]),
            swaps_per_min=float(per_device("swaps").sum()) / span * 60,
            swap_share=float(np.mean(per_device("swap_s"))) / span,
        )
        step.ok = (
            step.achieved >= 0.95 * offered
            and step.p99_ms <= bound_s * 1000
            and not step.bulk_p99_ms > self.bulk_bound_s * 1000  # (nan: no bulk call in the window)
            and not failed
        )
        step.harness = (
            max(step.cpu_front, step.cpu_host, step.cpu_nats, step.cpu_machine) > HARNESS_CPU
            or max(step.lag_front_ms, step.lag_host_ms) > bound_s * 100
        )
        return step


def next_arrival(rng: random.Random, after: float, start: float, rate: float, burst: float, period_s: float) -> float:
    """The next Poisson arrival after `after`; with `burst` b > 1 the rate is b x `rate` in the first
    `period_s` of every two and (2 - b) x `rate` in the second (the mean stays `rate`)."""
    if burst == 1.0:
        return after + rng.expovariate(rate)
    phase = int((after - start) // period_s)
    while True:
        phase_rate = rate * (burst if phase % 2 == 0 else max(1e-9, 2.0 - burst))
        arrival = after + rng.expovariate(phase_rate)
        boundary = start + (phase + 1) * period_s
        if arrival <= boundary:
            return arrival
        # Memoryless: draw again from the boundary at the next phase's rate. The phase counts on as
        # an integer: found again from `boundary - start`, which can round below (phase + 1) x period,
        # it would be this phase again, from its own end, for ever.
        after, phase = boundary, phase + 1


# --- report ---------------------------------------------------------------------------------------


def step_line(s: Step) -> str:
    return (
        f"  {s.dispatcher:>11} {s.workers:>2}w  rate {s.rate:6.1f}  offered {s.offered:6.1f}  achieved "
        f"{s.achieved:6.1f} req/s  p50 {s.p50_ms:6.0f}  p99 {s.p99_ms:6.0f} ms  busy {s.busy:4.0%}  "
        + (f"bulk p99 {s.bulk_p99_ms:6.0f} ms ({s.bulk_answered})  " if s.bulk_p99_ms == s.bulk_p99_ms else "")
        + (f"loads {s.swaps_per_min:5.0f}/min ({s.swap_share:4.0%})  " if s.swaps_per_min else "")
        + f"failed {s.failed:>3}  naks {s.naks:>4}  cpu f/h/n/all {s.cpu_front:.2f}/{s.cpu_host:.2f}/"
        f"{s.cpu_nats:.2f}/{s.cpu_machine:.0%}  lag f/h {s.lag_front_ms:4.1f}/{s.lag_host_ms:4.1f} ms  "
        f"{'ok' if s.ok else '--'}{'!' if s.harness else ''}"
    )


def knee(steps: list[Step]) -> Step | None:
    passed = [s for s in steps if s.ok]
    return max(passed, key=lambda s: s.rate) if passed else None


def why_failed(s: Step, bound_s: float, bulk_bound_s: float = float("inf")) -> str:
    reasons = [
        f"answered {s.achieved / max(1e-9, s.offered):.0%}" if s.achieved < 0.95 * s.offered else "",
        f"p99 {s.p99_ms:,.0f} ms" if s.p99_ms > bound_s * 1000 else "",
        f"bulk p99 {s.bulk_p99_ms:,.0f} ms" if s.bulk_p99_ms > bulk_bound_s * 1000 else "",
        f"{s.failed} failed" if s.failed else "",
    ]
    return f"{s.rate:,.0f} req/s: " + ", ".join(r for r in reasons if r)


def table(
    title: str,
    results: dict[str, list[Step]],
    peak_tokens_per_s: float | None,
    bound_s: float,
    bulk_bound_s: float = float("inf"),
) -> str:
    lines = [
        title,
        (
            f"{'dispatcher':>12} {'knee req/s':>10} {'tokens/s':>9} {'of peak':>7} {'busy':>5} "
            f"{'p50 ms':>6} {'p99 ms':>6} {'bulk p99':>8} {'loads/min':>9} {'naks':>5} {'cpu f/h/n/all':>19}  "
            "first failing step"
        ),
    ]
    for name, steps in results.items():
        best = knee(steps)
        later = [s for s in steps if not s.ok and (best is None or s.rate > best.rate)]
        first = min(later, key=lambda s: s.rate) if later else None
        fail = why_failed(first, bound_s, bulk_bound_s) if first else "none (the ramp ended)"
        if best is None:
            lines.append(
                f"{name:>12} {'-':>10} {'':>9} {'':>7} {'':>5} {'':>6} {'':>6} {'':>8} {'':>9} {'':>5} {'':>19}  {fail}"
            )
            continue
        cpu = f"{best.cpu_front:.2f}/{best.cpu_host:.2f}/{best.cpu_nats:.2f}/{best.cpu_machine:.0%}"
        of_peak = f"{best.tokens_per_s / peak_tokens_per_s:7.0%}" if peak_tokens_per_s else f"{'-':>7}"
        lines.append(
            f"{name:>12} {best.achieved:10.1f} {best.tokens_per_s:9,.0f} {of_peak} {best.busy:5.0%} "
            f"{best.p50_ms:6.0f} {best.p99_ms:6.0f} {best.bulk_p99_ms:8.0f} {best.swaps_per_min:9.0f} "
            f"{best.naks:5d} {cpu:>18}{'!' if best.harness else ' '}  {fail}"
        )
    return "\n".join(lines)


def ratio(a: Step | None, b: Step | None) -> str:
    return f"{a.achieved / b.achieved:.2f}x" if a and b and b.achieved else "n/a"


# --- main -----------------------------------------------------------------------------------------


MIX_ARGS = (
    "--workers=16",
    "--slow-share=0.25",
    "--slow-factor=2",
    "--models=6",
    "--zipf=1.1",
    "--resident=2",
    "--swap-ms=50",
    "--bulk-share=0.005",
    "--burst=1.5",
    "--burst-period-s=5",
    "--duration-s=30",
    "--warmup-s=5",
    "--limit=off",
    f"--dispatchers={MIX_DISPATCHERS}",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", default="4,8,16", help="worker counts, comma-separated (default 4,8,16)")
    ap.add_argument(
        "--dispatchers",
        default=",".join(DISPATCHERS),
        help=f"any of {', '.join(DISPATCHERS + MORE_DISPATCHERS)} (default {', '.join(DISPATCHERS)})",
    )
    ap.add_argument(
        "--mix",
        action="store_true",
        help="issue 38's mix: 16 workers (4 of them 2x slower), 6 models, 2 loaded per device, 50 ms loads, "
        "0.5 %% bulk calls of 64-2,048 texts, bursts 1.5x/0.5x every 5 s, 30 s steps; dispatchers "
        f"{MIX_DISPATCHERS}; each flag given after it overrides it",
    )
    ap.add_argument(
        "--duration-s", type=float, default=5.0, help="seconds per ramp step, 1 s of it warm-up (default 5)"
    )
    ap.add_argument("--refine", type=int, default=1, help="bisections between the knee and the first failing step")
    ap.add_argument("--quick", action="store_true", help="4 workers, 2.5 s steps, a short gateway ramp (< 2 min)")
    ap.add_argument("--batch-ms", type=float, default=2.0, help="fixed cost of a batch (default 2, before --slowdown)")
    ap.add_argument("--token-us", type=float, default=20.0, help="cost per token (default 20, before --slowdown)")
    ap.add_argument(
        "--switch-ms",
        type=float,
        default=0.0,
        help="extra cost of a batch whose model is not the last one's (default 0)",
    )
    ap.add_argument("--slowdown", type=float, default=10.0, help="device times are multiplied by this (default 10)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument(
        "--slow-share",
        type=float,
        default=0.0,
        help="this share of the devices is --slow-factor times slower (default 0: all alike)",
    )
    ap.add_argument("--slow-factor", type=float, default=2.0)
    ap.add_argument("--resident", type=int, help="models a device holds loaded at most (default: all, never loads)")
    ap.add_argument(
        "--swap-ms", type=float, default=0.0, help="device time of a model load (default 0, before --slowdown)"
    )
    ap.add_argument(
        "--target-batch-ms",
        type=float,
        default=100.0,
        help="the engine's target_batch_s: batches cut to this while large and small calls share a device "
        "(default 100, before --slowdown; 0: off)",
    )
    ap.add_argument("--bulk-share", type=float, default=0.0, help="the share of calls that are bulk (default 0)")
    ap.add_argument(
        "--bulk-items", default="64,2048", help="a bulk call's texts, log-uniform between (default 64,2048)"
    )
    ap.add_argument("--bulk-timeout-s", type=float, default=120.0, help="a bulk call's deadline (default 120)")
    ap.add_argument(
        "--bulk-p99-bound-ms", type=float, help="the bulk calls' p99 bound (default 3x a lone largest bulk call)"
    )
    ap.add_argument(
        "--burst", type=float, default=1.0, help="on/off bursts: b x the rate, then (2 - b) x (default 1: none)"
    )
    ap.add_argument("--burst-period-s", type=float, default=5.0, help="each on and each off phase (default 5)")
    ap.add_argument("--warmup-s", type=float, help="the start of each step left out (default min(1, duration / 4))")
    ap.add_argument("--models", type=int, default=8, help="model ids (default 8)")
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity exponent, 0 for uniform (default 1.1)")
    ap.add_argument("--report-ms", type=float, default=100.0, help="ll-report: workers' load reports (default 100)")
    ap.add_argument(
        "--p99-bound-ms",
        type=float,
        help="the knee's p99 bound on queries (default 10x a lone mean query, + a load with --resident, + a "
        "target batch with bulk calls)",
    )
    ap.add_argument("--prefetch-s", type=float, help="pull: ClusterSettings.prefetch_s (default shoal's, 0.4)")
    ap.add_argument("--min-inflight-tokens", type=int, help="pull: ClusterSettings.min_inflight_tokens (default 4096)")
    ap.add_argument(
        "--cold-pull-after-s",
        type=float,
        help="pull: ClusterSettings.cold_pull_after_s (default: a simulated load's time with --resident, as an "
        "operator sets it to their models' load time; else shoal's)",
    )
    ap.add_argument("--timeout-s", type=float, default=30.0, help="each call's deadline (default 30)")
    ap.add_argument("--limit", default="on", choices=("on", "off", "only"), help="the gateway-limit ramp (default on)")
    ap.add_argument("--limit-dispatchers", default="pull,round-robin")
    ap.add_argument("--limit-workers", type=int, default=8)
    ap.add_argument("--limit-hosts", type=int, default=2, help="device host processes of the gateway-limit ramp")
    ap.add_argument("--limit-rates", default="200,400,600,800,1000,1200,1500,2000")
    ap.add_argument("--limit-p99-ms", type=float, default=1000.0, help="gateway limit: the p99 a step may have")
    ap.add_argument("--out", help="write every step as JSON here")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mix" in argv:  # the preset first, so that flags given with it override it
        argv = [*MIX_ARGS, *argv]
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.duration_s, args.refine, args.limit_rates = "4", 2.5, 0, "200,400,800"
    return args


def fleet_of(args: argparse.Namespace) -> tuple[list[str], Cost, Workload, float | None]:
    """The models, a device's batch cost (slowdown applied), the load and the target batch time the
    flags describe (this bench's and bench/cluster_sim.py's)."""
    model_ids = [f"sim/model-{i}" for i in range(args.models)]
    scale = args.slowdown
    cost = Cost(
        args.batch_ms / 1000 * scale,
        args.token_us / 1e6 * scale,
        args.switch_ms / 1000 * scale,
        args.max_batch_tokens,
        args.swap_ms / 1000 * scale,
    )
    low, high = (int(n) for n in args.bulk_items.split(","))
    workload = Workload(
        model_ids,
        args.zipf,
        args.timeout_s,
        bulk_share=args.bulk_share,
        bulk_items=(low, high),
        bulk_timeout_s=args.bulk_timeout_s,
    )
    target_batch_s = args.target_batch_ms / 1000 * scale if args.target_batch_ms else None
    return model_ids, cost, workload, target_batch_s


def device_costs(cost: Cost, num_workers: int, args: argparse.Namespace) -> list[Cost]:
    """Each device's cost: --slow-share of them --slow-factor times slower (the last ones)."""
    num_slow = round(num_workers * args.slow_share)
    slow = replace(
        cost,
        batch_s=cost.batch_s * args.slow_factor,
        token_s=cost.token_s * args.slow_factor,
        switch_s=cost.switch_s * args.slow_factor,
    )
    return [cost] * (num_workers - num_slow) + [slow] * num_slow


async def main_async(args) -> int:
    model_ids, cost, workload, target_batch_s = fleet_of(args)
    scale = args.slowdown
    low, high = (int(n) for n in args.bulk_items.split(","))
    lone_s = cost.of(round(workload.query_mean_tokens), False)
    # What one query may wait: ten of its own, a load of its model, one (time-cut) batch of a bulk call.
    waits = [(10 * lone_s, f"10 x {lone_s * 1000:.0f} ms, a lone mean query")]
    if args.resident and cost.swap_s:
        waits.append((cost.swap_s, "a load"))
    if args.bulk_share:
        waits.append((target_batch_s or cost.of(cost.max_batch_tokens, False), "a bulk call's batch"))
    bound_s = args.p99_bound_ms / 1000 if args.p99_bound_ms else sum(w for w, _ in waits)
    why_bound = "given" if args.p99_bound_ms else " + ".join(f"{w * 1000:.0f} ms {what}" for w, what in waits)
    largest_s = cost.of(round(high * 46), False) + cost.batch_s * (high * 46 // cost.max_batch_tokens)
    bulk_bound_s = (
        (args.bulk_p99_bound_ms / 1000 if args.bulk_p99_bound_ms else 3 * largest_s)
        if args.bulk_share
        else float("inf")
    )
    cold_after_s = args.cold_pull_after_s
    if cold_after_s is None and args.resident and args.swap_ms:
        cold_after_s = cost.swap_s
    tuned = (
        ("prefetch_s", args.prefetch_s),
        ("min_inflight_tokens", args.min_inflight_tokens),
        ("cold_pull_after_s", cold_after_s),
    )
    cluster = "shoal's ClusterSettings" + "".join(f", {name} {value}" for name, value in tuned if value is not None)
    print("shoal cluster bench: pull (JetStream + real Workers) vs push routers, on simulated devices")
    print(
        machine_line(
            os.getloadavg(), "nats-server, the gateway/router and the load in one process, the devices in another"
        )
    )
    resident = f"{args.resident} of {args.models} models loaded at most" if args.resident else "every model loaded"
    print(
        f"device:      {cost.batch_s * 1000:g} ms + {cost.token_s * 1e6:g} us/token a batch ({args.batch_ms:g} ms + "
        f"{args.token_us:g} us x slowdown {scale:g}), +{cost.switch_s * 1000:g} ms on a model switch, batches of "
        f"one model <= {cost.max_batch_tokens} tokens (the engine's scheduler"
        + (f", cut to {target_batch_s * 1000:g} ms while bulk and small calls share it" if target_batch_s else "")
        + f"); peak {cost.peak_tokens_per_s:,.0f} tokens/s;\n             {resident}"
        + (f", a load {cost.swap_s * 1000:g} ms (LRU of the idle ones)" if args.resident else "")
    )
    bulk = (
        f"; {args.bulk_share:.1%} bulk calls of {low:,}-{high:,} texts (log-uniform; {workload.bulk_token_share:.0%} "
        f"of the tokens, deadline {args.bulk_timeout_s:g} s)"
        if args.bulk_share
        else ""
    )
    bursts = (
        f"; bursts {args.burst:g}x / {2 - args.burst:g}x the rate, {args.burst_period_s:g} s each"
        if args.burst != 1
        else ""
    )
    print(
        f"load:        Poisson, 1-8 texts of 4-48 words a query, {workload.query_mean_tokens:.0f} tokens a query"
        f"{bulk}; {workload.mean_tokens:.0f} tokens a call (gateway estimate){bursts}; {args.models} models, "
        f"shares {', '.join(f'{s:.2f}' for s in workload.shares)}"
    )
    print(
        f"knee:        answered >= 95 % of arrivals, queries' p99 <= {bound_s * 1000:.0f} ms ({why_bound})"
        + (f", bulk p99 <= {bulk_bound_s:.0f} s (3 x a lone {high:,}-text call)" if args.bulk_share else "")
        + f", none failed; {args.duration_s:g} s steps; ll-report every {args.report_ms:g} ms"
    )
    print(f"pull:        {cluster}; heartbeat 0.5 s")
    print(
        "columns:     busy = modelled useful device time (batches, not loads) / wall time, mean over devices; of "
        "peak = tokens/s over the fleet's peak;\n             loads/min = model loads on the whole fleet; "
        "cpu f/h/n/all = cores used by this process / the busiest device host / nats-server, and the machine's "
        "share in use; ! = the harness may have limited it\n",
        flush=True,
    )
    all_steps: list[Step] = []
    async with Bench(args, workload, model_ids) as bench:
        bench.bulk_bound_s = bulk_bound_s
        bench.swap_tokens = cost.swap_s / cost.token_s if cost.token_s else 0.0
        bench.target_batch_s = target_batch_s
        if args.limit != "only":
            tables, summary = [], []
            for num_workers in [int(n) for n in args.workers.split(",")]:
                num_slow = round(num_workers * args.slow_share)
                costs = device_costs(cost, num_workers, args)
                peak_tokens_per_s = sum(c.peak_tokens_per_s for c in costs)
                peak_req_s = peak_tokens_per_s / workload.mean_tokens
                results = {}
                for name in args.dispatchers.split(","):
                    results[name] = await bench.config(name, costs, [f * peak_req_s for f in RAMP], bound_s)
                    all_steps += results[name]
                slowed = f" ({num_slow} of them {args.slow_factor:g}x slower)" if num_slow else ""
                title = (
                    f"{num_workers} workers{slowed}: fleet peak {peak_req_s:,.0f} req/s "
                    f"({peak_tokens_per_s:,.0f} tokens/s)"
                )
                tables.append(table(title, results, peak_tokens_per_s, bound_s, bulk_bound_s))
                print("\n" + tables[-1] + "\n", flush=True)
                knees = {name: knee(steps) for name, steps in results.items()}
                summary.append(
                    f"{num_workers:>3} workers: "
                    + ", ".join(
                        f"{name}/round-robin {ratio(knees[name], knees.get('round-robin'))} (busy "
                        f"{knees[name].busy:.0%})"
                        if knees[name]
                        else f"{name}: no knee"
                        for name in knees
                        if name != "round-robin"
                    )
                )
            if len(tables) > 1:  # each was printed as it came: all of them again, together
                print("\n\n".join(tables))
            print("\nthroughput at the knee over round-robin's, and the devices' busy share there:")
            print("\n".join(summary))
            pull = knees.get("pull")
            if pull:
                aims = [f"busy {pull.busy:.0%} (>= 90 %: {'met' if pull.busy >= 0.9 else 'NOT met'})"]
                for name, want in (("round-robin", 1.5), ("ll-fresh", 1.1), ("ll-model", 1.0)):
                    if name in knees:
                        other = knees[name]
                        met = "met" if other is None or pull.achieved >= want * other.achieved else "NOT met"
                        aims.append(f"{ratio(pull, other)} {name}'s throughput (>= {want:g}x: {met})")
                print(f"aim at {num_workers} workers, pull: " + ", ".join(aims))
            sys.stdout.flush()
        if args.limit != "off":
            zero = replace(cost, batch_s=0.0, token_s=0.0, switch_s=0.0)
            rates = [float(r) for r in args.limit_rates.split(",")]
            print(
                f"\ngateway limit: zero-cost devices, {args.limit_workers} workers in {args.limit_hosts} host "
                f"processes, one gateway (or router) in this process; a step follows when it answers >= 95 % of "
                f"arrivals with p99 <= {args.limit_p99_ms:g} ms",
                flush=True,
            )
            results = {}
            for name in args.limit_dispatchers.split(","):
                results[name] = await bench.config(
                    name, [zero] * args.limit_workers, rates, args.limit_p99_ms / 1000, num_hosts=args.limit_hosts
                )
                all_steps += results[name]
            print(
                "\n"
                + table(
                    f"gateway limit, {args.limit_workers} zero-cost workers", results, None, args.limit_p99_ms / 1000
                )
            )
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(s) for s in all_steps], indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
