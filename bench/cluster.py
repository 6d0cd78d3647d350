"""Cluster: workers pulling from a central queue, against top-down routers that push to workers.

The claim under test (DESIGN §5): with many small requests, a central queue that workers pull
from keeps devices busy where a router that pushes each request into a worker's own queue leaves
them idle and loses throughput. Same simulated devices, same load (the same seeded arrivals and
calls), same run; the dispatchers:

    pull         shoal's real path: `RemoteService` (the gateway) publishes each call to the
                 JetStream work queue of a real nats-server; one real `Worker` per device pulls
                 what its free capacity predicts and feeds its device.
    round-robin  a router that sends each call to the next worker in turn over the same NATS (core
                 request/reply, one subject per worker: no JetStream, no acks); each device
                 batches only what is in its own queue.
    ll-report    the same router, to the worker with the least outstanding tokens in the load
                 reports the workers publish every --report-ms (ties: any of them).
    ll-fresh     the same, from the router's own count of tokens sent and not yet answered (exact
                 with one router: the best case of a push router).

A simulated device (`SimDevice`, a `Service`) queues calls and runs batches of one model, the
model of the oldest queued call first, up to --max-batch-tokens; a batch costs --batch-ms +
--token-us per token (+ --switch-ms when its model is not the previous batch's), spent in
`asyncio.sleep`, all times --slowdown. The slowdown is there because this harness runs up to 16
devices, 16 Workers, a gateway, NATS and the load generator on 2 cores: devices are slowed until
the harness keeps up. Utilization and ratios carry over; req/s scale with 1/slowdown, latencies
with slowdown (but shoal's own time constants, e.g. the 50 ms nak delay, do not). A call's tokens
are `protocol.estimate_tokens` (the gateway's estimate, so every router knows them exactly). Every
model is resident on every device; --slow-share makes some devices --slow-factor times slower. A
device reports its measured tokens/s through `capacity()`, which the real Worker sizes pulls by.

Load: open-loop Poisson arrivals of encode calls of 1-8 texts of 4-48 words over --models ids of
Zipf popularity; latency runs from each call's scheduled arrival. For each dispatcher and worker
count the rate ramps through fractions of the fleet's peak (`RAMP`) until a step fails, then
bisects --refine times; the knee is the highest passing step: answers >= 95 % of arrivals, p99 <=
the bound (default 10x a lone mean call's device time), no call failed. Each step's line ends in
`!` when the harness may have limited it: a process near a full core, the machine near both, or an
event loop late by over a tenth of the bound.

Processes: this one runs nats-server (a child), the load, and the gateway or router; the devices
(with their Workers) run in a second Python process, so one event loop never carries both ends.

    python bench/cluster.py                 # 4, 8, 16 workers, then the gateway limit (~11 min)
    python bench/cluster.py --quick         # 4 workers, short steps (< 2 min)

(One file over 500 lines: the device model, the device host, three routers and the harness belong
to one measurement and are read together.)
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

from shoal import calls
from shoal.calls import EncodeCall, EncodedItem, EncodeResult, ErrorResult
from shoal.catalog import Catalog
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port, start_nats
from shoal.errors import DeadlineExceeded, InvalidRequest, ShoalError, UnknownModel
from shoal.metrics import Metrics
from shoal.service import Capacity, CardProblem, ModelStatus
from spawn import machine_line

DISPATCHERS = ("pull", "round-robin", "ll-report", "ll-fresh")
# Ramp steps, as fractions of the fleet's peak requests/s; then --refine bisections at the knee.
RAMP = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
MAX_QUEUED_TOKENS = 1_000_000
HARNESS_CPU = 0.9  # a process above this many cores, or the machine above this share, limits the harness


# --- the simulated device -----------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """What one batch costs a simulated device, in seconds (slowdown applied)."""

    batch_s: float
    token_s: float
    switch_s: float
    max_batch_tokens: int

    def of(self, num_tokens: int, switched: bool) -> float:
        return self.batch_s + self.token_s * num_tokens + (self.switch_s if switched else 0.0)

    @property
    def peak_tokens_per_s(self) -> float:
        """Full batches of one model, back to back."""
        return self.max_batch_tokens / max(1e-9, self.of(self.max_batch_tokens, False))


@dataclass(eq=False)
class _Pending:
    tokens: int
    items: int
    arrived: float
    deadline: float
    future: asyncio.Future  # (queue_s, inference_s); a cancelled caller cancels it


class SimDevice:
    """A `Service` over a batch-cost model: `run` queues the call; one loop runs the batches."""

    def __init__(self, name: str, model_ids: list[str], cost: Cost) -> None:
        self.name = name
        self.cost = cost
        self.metrics = Metrics()
        self._statuses = {
            m: ModelStatus(
                id=m,
                tasks=("encode",),
                outputs=("dense",),
                max_length=512,
                verified="simulated",
                loaded=True,
                state="loaded",
                architecture="sim",
            )
            for m in model_ids
        }
        self._queues: dict[str, collections.deque[_Pending]] = {m: collections.deque() for m in model_ids}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_model: str | None = None
        self._rate: float | None = None  # tokens/s of recent batches (the engine's 0.8/0.2 average)
        self.queued_tokens = 0
        self.running_tokens = 0
        # What the host reports: modelled busy seconds, seconds the event loop overslept them, work done.
        self.busy_s = 0.0
        self.overslept_s = 0.0
        self.tokens = 0

    @property
    def outstanding_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"sim {self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def warm(self, model_ids: list[str]) -> None:
        """Every model is resident."""

    @property
    def ready(self) -> bool:
        return self._task is not None

    def models(self) -> list[ModelStatus]:
        return list(self._statuses.values())

    def model(self, model_id: str) -> ModelStatus:
        if model_id not in self._statuses:
            raise UnknownModel(f"{model_id} is not simulated here")
        return self._statuses[model_id]

    def has_model(self, model_id: str) -> bool:
        return model_id in self._statuses

    def problems(self) -> list[CardProblem]:
        return []

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        return self.model(model_id)

    async def tokenize(
        self, model_id: str, texts: list[str], add_special_tokens: bool = True, prompt_name: str | None = None
    ):
        raise InvalidRequest("a simulated device has no tokenizer")

    def capacity(self) -> Capacity:
        return Capacity(self.outstanding_tokens, MAX_QUEUED_TOKENS, self._rate)

    async def run(self, call) -> EncodeResult:
        loop = asyncio.get_running_loop()
        self.model(call.model)
        now = loop.time()
        pending = _Pending(
            p.estimate_tokens(call), len(call.items), now, now + (call.timeout_s or 300.0), loop.create_future()
        )
        self._queues[call.model].append(pending)
        self.queued_tokens += pending.tokens
        self._wake.set()
        queue_s, inference_s = await pending.future
        return EncodeResult(
            items=[EncodedItem()] * pending.items, num_tokens=pending.tokens, queue_s=queue_s, inference_s=inference_s
        )

    def _next_batch(self, now: float) -> tuple[str | None, list[_Pending]]:
        """The model whose oldest live call is the oldest, and its calls in order up to the token
        budget; cancelled and expired calls leave the queue first."""
        for queue in self._queues.values():
            while queue and (queue[0].future.done() or queue[0].deadline < now):
                dropped = queue.popleft()
                self.queued_tokens -= dropped.tokens
                if not dropped.future.done():
                    dropped.future.set_exception(DeadlineExceeded("expired in the simulated device's queue"))
        heads = [(queue[0].arrived, model) for model, queue in self._queues.items() if queue]
        if not heads:
            return None, []
        model = min(heads)[1]
        queue, batch, num_tokens = self._queues[model], [], 0
        while queue and (not batch or num_tokens + queue[0].tokens <= self.cost.max_batch_tokens):
            pending = queue.popleft()
            self.queued_tokens -= pending.tokens
            if not pending.future.done():
                batch.append(pending)
                num_tokens += pending.tokens
        return model, batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            model, batch = self._next_batch(loop.time())
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            num_tokens = sum(pending.tokens for pending in batch)
            cost = self.cost.of(num_tokens, self._last_model not in (None, model))
            self._last_model = model
            self.running_tokens = num_tokens
            started = loop.time()
            await asyncio.sleep(cost)
            elapsed = loop.time() - started
            self.running_tokens = 0
            self.busy_s += cost
            self.overslept_s += elapsed - cost
            self.tokens += num_tokens
            if elapsed > 0:
                rate = num_tokens / elapsed
                self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_result((started - pending.arrived, elapsed))


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
    from shoal.config import ClusterSettings

    quiet()
    nc = await p.connect(spec.nats_url, f"bench-host {spec.tag}.{index}")
    devices = [SimDevice(f"sim{i}", list(spec.model_ids), cost) for i, cost in zip(spec.devices, spec.costs)]
    lag = LagMonitor()
    lag.start()
    stop, done = asyncio.Event(), asyncio.Event()
    workers: list = []
    running: set[asyncio.Task] = set()  # push calls in flight (held, so they are not collected)
    if spec.mode == "pull":
        settings = ClusterSettings(nats_url=spec.nats_url, pool=spec.tag, **spec.cluster)
        workers = [
            Worker([device], settings, devices=[device.name], metrics=Metrics(), worker_id=f"{spec.tag}-{device.name}")
            for device in devices
        ]
        tasks = [asyncio.create_task(worker.run(stop)) for worker in workers]
    else:
        for i, device in zip(spec.devices, devices):
            await device.start()
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
    """The device's outstanding tokens every `report_s`, from a random phase (as independent workers)."""
    await asyncio.sleep(random.random() * spec.report_s)
    while not stop.is_set():
        await nc.publish(load_subject(spec.tag), msgspec.msgpack.encode((index, device.outstanding_tokens)))
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
    """A top-down router: one subject per worker, core NATS request/reply."""

    def __init__(self, nc, tag: str, num_workers: int, policy: str) -> None:
        self.nc, self.tag, self.policy = nc, tag, policy
        self._next = 0
        self._sent_tokens = [0] * num_workers  # sent and not yet answered (ll-fresh)
        self._reported = [0] * num_workers  # each worker's last load report (ll-report)
        self._sub = None

    async def start(self, num_workers: int) -> None:
        if self.policy == "ll-report":
            self._sub = await self.nc.subscribe(load_subject(self.tag), cb=self._on_report)

    async def _on_report(self, msg) -> None:
        index, tokens = msgspec.msgpack.decode(msg.data)
        self._reported[index] = tokens

    def _choose(self) -> int:
        if self.policy == "round-robin":
            self._next = (self._next + 1) % len(self._sent_tokens)
            return self._next
        loads = self._reported if self.policy == "ll-report" else self._sent_tokens
        least = min(loads)
        return random.choice([i for i, load in enumerate(loads) if load == least])

    async def run(self, call):
        index = self._choose()
        tokens = p.estimate_tokens(call)
        self._sent_tokens[index] += tokens
        try:
            msg = await self.nc.request(push_subject(self.tag, index), calls.encode(call), timeout=call.timeout_s)
        finally:
            self._sent_tokens[index] -= tokens
        result = calls.decode_result(msg.data)
        if isinstance(result, ErrorResult):
            raise result.error()
        return result

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


# --- load and measurement -----------------------------------------------------------------------


class Workload:
    """Seeded encode calls: 1-8 texts of 4-48 pseudo-words, models by a Zipf law."""

    def __init__(self, model_ids: list[str], zipf_s: float, timeout_s: float, seed: int = 0) -> None:
        rng = random.Random(seed)
        words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 10))) for _ in range(3000)]
        texts = [" ".join(rng.choices(words, k=rng.randint(4, 48))) for _ in range(5000)]
        weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(model_ids))]
        self.shares = [w / sum(weights) for w in weights]
        self.calls = [
            EncodeCall(
                model=rng.choices(model_ids, weights)[0],
                items=rng.sample(texts, rng.randint(1, 8)),
                timeout_s=timeout_s,
            )
            for _ in range(20_000)
        ]
        self.mean_tokens = float(np.mean([p.estimate_tokens(c) for c in self.calls]))
        self._at = 0

    def rewind(self) -> None:
        self._at = 0

    def next(self) -> EncodeCall:
        self._at = (self._at + 1) % len(self.calls)
        return self.calls[self._at]


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


class Bench:
    """One nats-server and this process's NATS connection; hosts and dispatchers per configuration."""

    def __init__(self, args, workload: Workload, model_ids: list[str]) -> None:
        self.args, self.workload, self.model_ids = args, workload, model_ids
        self.cluster: dict = {"heartbeat_s": 0.5, "worker_ttl_s": 3.0}
        if args.prefetch_s is not None:
            self.cluster["prefetch_s"] = args.prefetch_s
        if args.min_inflight_tokens is not None:
            self.cluster["min_inflight_tokens"] = args.min_inflight_tokens
        self.warmup_s = min(1.0, args.duration_s / 4)
        self.runs = 0

    async def __aenter__(self):
        quiet()
        self.store = Path(tempfile.mkdtemp(prefix="shoal-bench-nats-"))
        port = free_port()
        self.nats = start_nats(port, self.store)
        self.url = f"nats://127.0.0.1:{port}"
        self.nc = await p.connect(self.url, "bench-front")
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
        ctx = multiprocessing.get_context("spawn")
        hosts = []
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
                self.cluster,
            )
            hosts.append(ctx.Process(target=host_main, args=(spec, index), daemon=True))
            hosts[-1].start()
        front = (
            PullDispatcher(self.url, tag, self.cluster)
            if mode == "pull"
            else PushDispatcher(self.nc, tag, num_workers, dispatcher)
        )
        try:
            await self._wait_hosts(tag, hosts, num_workers)
            await front.start(num_workers)
            steps: list[Step] = []
            for rate in rates:
                steps.append(await self._step(front, dispatcher, num_workers, tag, hosts, rate, bound_s))
                if not steps[-1].ok:
                    break
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
        """One open-loop Poisson step at `rate`; the window is the step after its warm-up."""
        loop = asyncio.get_running_loop()
        await self._until_idle(tag, hosts)
        rng = random.Random(f"{num_workers} {rate:.3f}")  # every dispatcher gets the same arrivals and calls
        self.workload.rewind()
        records: list[tuple[float, float, bool]] = []  # (scheduled arrival, answered at, ok)
        arrivals: list[float] = []
        running: dict[asyncio.Task, float] = {}  # -> its scheduled arrival
        snapshots: dict[str, tuple] = {}

        async def one(call, arrival: float) -> None:
            try:
                await front.run(call)
                records.append((arrival, loop.time(), True))
            except ShoalError:
                records.append((arrival, loop.time(), False))

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
            arrival += rng.expovariate(rate)
            if arrival > window[1]:
                break
            if arrival > loop.time():
                await asyncio.sleep(arrival - loop.time())
            task = asyncio.create_task(one(self.workload.next(), arrival))
            arrivals.append(arrival)
            running[task] = arrival
            task.add_done_callback(lambda t: running.pop(t, None))
        await asyncio.gather(*snapping)
        if running:
            await asyncio.wait(set(running), timeout=max(2.0, 2 * bound_s))
        unfinished = sum(1 for arrival in running.values() if arrival >= window[0])
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
        latencies = [done - arrival for arrival, done, _ in in_window] + [float("inf")] * unfinished
        # "higher": no interpolation, so unanswered calls (inf) give inf, not nan.
        p50_s = float(np.percentile(latencies, 50, method="higher")) if latencies else float("nan")
        lead = min(p50_s, self.warmup_s)  # a p50 beyond the warm-up fails the step on p99 anyway
        offered = sum(1 for a in arrivals if t0 - lead <= a <= t1 - lead) / span
        failed = unfinished + sum(1 for r in in_window if not r[2])

        def per_device(key: str) -> np.ndarray:
            return np.concatenate([np.subtract(b[key], a[key]) for a, b in zip(hosts0, hosts1)])

        busy, overslept = per_device("busy_s"), per_device("overslept_s")
        step = Step(
            dispatcher=dispatcher,
            workers=num_workers,
            rate=rate,
            offered=offered,
            achieved=sum(1 for _, done, ok in records if ok and t0 <= done <= t1) / span,
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
        )
        step.ok = step.achieved >= 0.95 * offered and step.p99_ms <= bound_s * 1000 and not failed
        step.harness = (
            max(step.cpu_front, step.cpu_host, step.cpu_nats, step.cpu_machine) > HARNESS_CPU
            or max(step.lag_front_ms, step.lag_host_ms) > bound_s * 100
        )
        return step


# --- report ---------------------------------------------------------------------------------------


def step_line(s: Step) -> str:
    return (
        f"  {s.dispatcher:>11} {s.workers:>2}w  rate {s.rate:6.1f}  offered {s.offered:6.1f}  achieved "
        f"{s.achieved:6.1f} req/s  p50 {s.p50_ms:6.0f}  p99 {s.p99_ms:6.0f} ms  busy {s.busy:4.0%}  "
        f"failed {s.failed:>3}  naks {s.naks:>4}  cpu f/h/n/all {s.cpu_front:.2f}/{s.cpu_host:.2f}/"
        f"{s.cpu_nats:.2f}/{s.cpu_machine:.0%}  lag f/h {s.lag_front_ms:4.1f}/{s.lag_host_ms:4.1f} ms  "
        f"{'ok' if s.ok else '--'}{'!' if s.harness else ''}"
    )


def knee(steps: list[Step]) -> Step | None:
    passed = [s for s in steps if s.ok]
    return max(passed, key=lambda s: s.rate) if passed else None


def why_failed(s: Step, bound_s: float) -> str:
    reasons = [
        f"answered {s.achieved / max(1e-9, s.offered):.0%}" if s.achieved < 0.95 * s.offered else "",
        f"p99 {s.p99_ms:,.0f} ms" if s.p99_ms > bound_s * 1000 else "",
        f"{s.failed} failed" if s.failed else "",
    ]
    return f"{s.rate:,.0f} req/s: " + ", ".join(r for r in reasons if r)


def table(title: str, results: dict[str, list[Step]], peak_tokens_per_s: float | None, bound_s: float) -> str:
    lines = [
        title,
        (
            f"{'dispatcher':>12} {'knee req/s':>10} {'tokens/s':>9} {'of peak':>7} {'busy':>5} "
            f"{'p50 ms':>6} {'p99 ms':>6} {'naks':>5} {'cpu f/h/n/all':>19}  first failing step"
        ),
    ]
    for name, steps in results.items():
        best = knee(steps)
        later = [s for s in steps if not s.ok and (best is None or s.rate > best.rate)]
        fail = why_failed(min(later, key=lambda s: s.rate), bound_s) if later else "none (the ramp ended)"
        if best is None:
            lines.append(f"{name:>12} {'-':>10} {'':>9} {'':>7} {'':>5} {'':>6} {'':>6} {'':>5} {'':>19}  {fail}")
            continue
        cpu = f"{best.cpu_front:.2f}/{best.cpu_host:.2f}/{best.cpu_nats:.2f}/{best.cpu_machine:.0%}"
        of_peak = f"{best.tokens_per_s / peak_tokens_per_s:7.0%}" if peak_tokens_per_s else f"{'-':>7}"
        lines.append(
            f"{name:>12} {best.achieved:10.1f} {best.tokens_per_s:9,.0f} {of_peak} {best.busy:5.0%} "
            f"{best.p50_ms:6.0f} {best.p99_ms:6.0f} {best.naks:5d} {cpu:>18}{'!' if best.harness else ' '}  "
            f"{fail}"
        )
    return "\n".join(lines)


def ratio(a: Step | None, b: Step | None) -> str:
    return f"{a.achieved / b.achieved:.2f}x" if a and b and b.achieved else "n/a"


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", default="4,8,16", help="worker counts, comma-separated (default 4,8,16)")
    ap.add_argument(
        "--dispatchers", default=",".join(DISPATCHERS), help=f"any of {', '.join(DISPATCHERS)} (default all)"
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
    ap.add_argument("--models", type=int, default=8, help="model ids (default 8)")
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity exponent, 0 for uniform (default 1.1)")
    ap.add_argument("--report-ms", type=float, default=100.0, help="ll-report: workers' load reports (default 100)")
    ap.add_argument("--p99-bound-ms", type=float, help="the knee's p99 bound (default 10x a lone mean call's cost)")
    ap.add_argument("--prefetch-s", type=float, help="pull: ClusterSettings.prefetch_s (default shoal's, 0.2)")
    ap.add_argument("--min-inflight-tokens", type=int, help="pull: ClusterSettings.min_inflight_tokens (default 4096)")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="each call's deadline (default 30)")
    ap.add_argument("--limit", default="on", choices=("on", "off", "only"), help="the gateway-limit ramp (default on)")
    ap.add_argument("--limit-dispatchers", default="pull,round-robin")
    ap.add_argument("--limit-workers", type=int, default=8)
    ap.add_argument("--limit-hosts", type=int, default=2, help="device host processes of the gateway-limit ramp")
    ap.add_argument("--limit-rates", default="200,400,600,800,1000,1200,1500,2000")
    ap.add_argument("--limit-p99-ms", type=float, default=1000.0, help="gateway limit: the p99 a step may have")
    ap.add_argument("--out", help="write every step as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.duration_s, args.refine, args.limit_rates = "4", 2.5, 0, "200,400,800"
    return args


async def main_async(args) -> int:
    model_ids = [f"sim/model-{i}" for i in range(args.models)]
    scale = args.slowdown
    cost = Cost(
        args.batch_ms / 1000 * scale, args.token_us / 1e6 * scale, args.switch_ms / 1000 * scale, args.max_batch_tokens
    )
    workload = Workload(model_ids, args.zipf, args.timeout_s)
    lone_s = cost.of(round(workload.mean_tokens), False)
    bound_s = args.p99_bound_ms / 1000 if args.p99_bound_ms else 10 * lone_s
    tuned = (("prefetch_s", args.prefetch_s), ("min_inflight_tokens", args.min_inflight_tokens))
    cluster = "shoal's ClusterSettings" + "".join(f", {name} {value}" for name, value in tuned if value is not None)
    print("shoal cluster bench: pull (JetStream + real Workers) vs push routers, on simulated devices")
    print(
        machine_line(
            os.getloadavg(), "nats-server, the gateway/router and the load in one process, the devices in another"
        )
    )
    print(
        f"device:      {cost.batch_s * 1000:g} ms + {cost.token_s * 1e6:g} us/token a batch ({args.batch_ms:g} ms + "
        f"{args.token_us:g} us x slowdown {scale:g}), +{cost.switch_s * 1000:g} ms on a model switch, batches of "
        f"one model <= {cost.max_batch_tokens} tokens; peak {cost.peak_tokens_per_s:,.0f} tokens/s"
    )
    print(
        f"load:        Poisson, 1-8 texts of 4-48 words a call, {workload.mean_tokens:.0f} tokens a call (gateway "
        f"estimate); {args.models} models, shares {', '.join(f'{s:.2f}' for s in workload.shares)}"
    )
    print(
        f"knee:        answered >= 95 % of arrivals, p99 <= {bound_s * 1000:.0f} ms (10 x {lone_s * 1000:.0f} ms, "
        f"a lone mean call), none failed; {args.duration_s:g} s steps; ll-report every {args.report_ms:g} ms"
    )
    print(f"pull:        {cluster}; heartbeat 0.5 s")
    print(
        "columns:     busy = modelled device time / wall time, mean over devices; of peak = tokens/s over the "
        "fleet's peak;\n             cpu f/h/n/all = cores used by this process / the busiest device host / "
        "nats-server, and the machine's share in use; ! = the harness may have limited it\n",
        flush=True,
    )
    all_steps: list[Step] = []
    async with Bench(args, workload, model_ids) as bench:
        if args.limit != "only":
            tables, summary = [], []
            for num_workers in [int(n) for n in args.workers.split(",")]:
                num_slow = round(num_workers * args.slow_share)
                slow = replace(
                    cost,
                    batch_s=cost.batch_s * args.slow_factor,
                    token_s=cost.token_s * args.slow_factor,
                    switch_s=cost.switch_s * args.slow_factor,
                )
                costs = [cost] * (num_workers - num_slow) + [slow] * num_slow
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
                tables.append(table(title, results, peak_tokens_per_s, bound_s))
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
            print("\n\n".join(tables))
            print("\nthroughput at the knee over round-robin's, and the devices' busy share there:")
            print("\n".join(summary))
            pull, push = knees.get("pull"), knees.get("round-robin")
            if pull and push:
                print(
                    f"aim at {num_workers} workers, pull: busy {pull.busy:.0%} (>= 90 %: "
                    f"{'met' if pull.busy >= 0.9 else 'NOT met'}), {ratio(pull, push)} round-robin's throughput "
                    f"(>= 1.5x: {'met' if pull.achieved >= 1.5 * push.achieved else 'NOT met'})"
                )
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
