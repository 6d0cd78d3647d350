"""The costs bench/cluster_sim.py charges, measured on a real nats-server and shoal's real gateway
and worker on this machine (`python bench/cluster_sim.py calibrate`; writes cluster_sim_costs.json).

    nats-server (its CPU seconds from /proc, over thousands of operations on shoal's own stream
    and consumer settings, nats-py as the client):
        publish      js.publish of a call-sized message, awaited, 256 at a time
        pull         fetch(1) + ack, `concurrency` pullers: a pull request, a delivery, an ack
        batch        fetch(64) + ack: deliveries and acks, a pull request per 64
        empty        fetch(1, 5 ms) on an empty consumer, `concurrency` at once: a pull request, its 408
    (Operations one at a time cost nats-server several times more each: it sleeps and wakes
    between them. Under load, which is where a stream saturates, it does not.)
        api          a consumer info request (JetStream's API), `concurrency` at once
        core         a core message to one subscriber
        latency      half the median round trip of a ping (nc.flush)
    shoal (CPU seconds of its process per call, zero-cost devices, `concurrency` calls in flight):
        gateway      RemoteService.run in this process: per call, split between its publish and its
                     reply as nats-py's own publish and receive split; per heartbeat
        worker       16 Workers in one host process (as bench/cluster.py runs them): per call

A stream's server in the simulation is charged the whole of nats-server's CPU per operation,
though nats-server spreads part of it over its client connections' goroutines: one stream here
saturates no later than a real one would.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cluster_sim  # the estimate shim and COSTS_FILE
from cluster import Cost, SimDevice, Workload, proc_cpu_s, quiet
from shoal import calls
from shoal.catalog import Catalog
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port, start_nats
from shoal.config import ClusterSettings, Settings
from spawn import machine_line

POOL = "cal"
MODEL = "sim/model-0"


def settings(url: str, **kw: Any) -> ClusterSettings:
    return ClusterSettings(nats_url=url, pool=POOL, **kw)


async def _server_cpu(pid: int, work: Any) -> tuple[float, float]:
    """(nats-server CPU seconds, wall seconds) that `work()` took."""
    cpu0, wall0 = proc_cpu_s(pid), time.perf_counter()
    await work()
    await asyncio.sleep(0.2)  # the server finishes what it was sent
    return proc_cpu_s(pid) - cpu0, time.perf_counter() - wall0 - 0.2


async def measure_server(
    url: str, pid: int, n: int, body: bytes, headers: dict[str, str], concurrency: int
) -> dict[str, float]:
    nc = await p.connect(settings(url), "calibrate")
    js = nc.jetstream()
    await p.ensure_queue(js, settings(url))
    await p.ensure_consumer(js, settings(url), POOL, MODEL)
    subject = p.work_subject(POOL, MODEL)
    sub = await js.pull_subscribe_bind(durable=p.consumer_name(POOL, MODEL), stream=p.STREAM)
    out: dict[str, float] = {}

    ids = itertools.count()

    async def publish(count: int) -> None:  # each with its own Nats-Msg-Id, as the gateway's
        for start in range(0, count, 256):
            batch = range(min(256, count - start))
            await asyncio.gather(
                *(js.publish(subject, body, headers=headers | {p.MSG_ID: f"s{next(ids)}"}) for _ in batch)
            )

    # Each puller its own subscription (its own inbox), as each of shoal's Pullers.
    subs = [
        await js.pull_subscribe_bind(durable=p.consumer_name(POOL, MODEL), stream=p.STREAM) for _ in range(concurrency)
    ]

    async def pull_one(count: int) -> None:  # `concurrency` pullers, one call per pull
        left = iter(range(count))

        async def puller(sub: Any) -> None:
            for _ in left:
                for msg in await sub.fetch(1, timeout=5.0):
                    await msg.ack()

        await asyncio.gather(*(puller(sub) for sub in subs))

    async def pull_batch(count: int) -> None:
        left = iter(range(0, count, 64))

        async def puller(sub: Any) -> None:
            for _ in left:
                msgs = await sub.fetch(64, timeout=5.0)
                for msg in msgs:
                    await msg.ack()

        await asyncio.gather(*(puller(sub) for sub in subs[: max(1, concurrency // 8)]))

    async def empty(count: int) -> None:  # `concurrency` pulls at once, each expiring empty
        left = iter(range(count))

        async def puller(sub: Any) -> None:
            for _ in left:
                try:
                    await sub.fetch(1, timeout=0.005)
                except Exception:  # the 408 an empty pull ends with
                    pass

        await asyncio.gather(*(puller(sub) for sub in subs))

    cpu, _ = await _server_cpu(pid, lambda: publish(2 * n))
    out["publish_s"] = cpu / (2 * n)
    cpu_one, _ = await _server_cpu(pid, lambda: pull_one(n))
    cpu_batch, _ = await _server_cpu(pid, lambda: pull_batch(n))
    per_one, per_batch = cpu_one / n, cpu_batch / n  # fetch + deliver + ack;  deliver + ack + fetch / 64
    out["fetch_s"] = max(0.0, (per_one - per_batch) / (1 - 1 / 64))
    deliver_ack = per_batch - out["fetch_s"] / 64
    cpu_empty, _ = await _server_cpu(pid, lambda: empty(n // 4))
    out["empty_fetch_s"] = cpu_empty / (n // 4)
    # Deliveries against acks: publish again, take them unacked (batches), then ack them all.
    await publish(n)
    held: list[Any] = []

    async def take(count: int) -> None:
        while len(held) < count:
            held.extend(await sub.fetch(min(64, count - len(held)), timeout=5.0))

    async def ack_all() -> None:
        for msg in held:
            await msg.ack()
        await nc.flush()

    cpu_take, _ = await _server_cpu(pid, lambda: take(n))
    cpu_ack, _ = await _server_cpu(pid, ack_all)
    out["deliver_s"] = max(0.0, cpu_take / n - out["fetch_s"] / 64)
    out["ack_s"] = cpu_ack / n
    out["deliver_ack_check_s"] = deliver_ack

    # JetStream API requests: consumer info, `concurrency` at a time.
    async def infos(count: int) -> None:
        for start in range(0, count, concurrency):
            await asyncio.gather(
                *(
                    js.consumer_info(p.STREAM, p.consumer_name(POOL, MODEL))
                    for _ in range(min(concurrency, count - start))
                )
            )

    cpu_api, _ = await _server_cpu(pid, lambda: infos(n // 4))
    out["api_s"] = cpu_api / (n // 4)
    # Core messages, and the round trip.
    got = asyncio.Event()
    count = 0

    async def on_msg(msg: Any) -> None:
        nonlocal count
        count += 1
        if count >= n:
            got.set()

    await nc.subscribe("cal.core", cb=on_msg)

    async def core() -> None:
        for _ in range(n):
            await nc.publish("cal.core", body)
        await got.wait()

    cpu_core, _ = await _server_cpu(pid, core)
    out["core_s"] = cpu_core / n
    rtts = []
    for _ in range(500):
        started = time.perf_counter()
        await nc.flush()
        rtts.append(time.perf_counter() - started)
    out["latency_s"] = statistics.median(rtts) / 2
    await nc.close()
    return out


async def measure_client(url: str, n: int, body: bytes, headers: dict[str, str]) -> dict[str, float]:
    """nats-py's own CPU per JetStream publish (awaited, 256 at a time) and per core message received."""
    nc = await p.connect(settings(url), "calibrate-client")
    js = nc.jetstream()
    subject = p.work_subject(POOL, "sim/model-1")  # no consumer: the messages stay, nobody pulls them
    cpu0 = time.process_time()
    for start in range(0, n, 256):
        batch = range(start, min(n, start + 256))
        await asyncio.gather(*(js.publish(subject, body, headers=headers | {p.MSG_ID: f"c{i}"}) for i in batch))
    publish_s = (time.process_time() - cpu0) / n
    await js.purge_stream(p.STREAM, subject=subject)
    done = asyncio.Event()
    count = 0

    async def on_msg(msg: Any) -> None:
        nonlocal count
        count += 1
        if count >= n:
            done.set()

    sender = await p.connect(settings(url), "calibrate-sender")
    await nc.subscribe("cal.receive", cb=on_msg)
    await nc.flush()
    cpu0 = time.process_time()
    for _ in range(n):
        await sender.publish("cal.receive", body)
    sender_s = time.process_time() - cpu0
    await done.wait()
    receive_s = max(0.0, (time.process_time() - cpu0 - sender_s) / n)
    await sender.close()
    await nc.close()
    return {"publish_s": publish_s, "receive_s": receive_s}


def host_main(url: str, num_workers: int, model_ids: list[str], stop_file: str) -> None:
    """Zero-cost devices behind real Workers, in one process, until `stop_file` exists."""

    async def run() -> None:
        from shoal.cluster.worker import Worker

        quiet()
        stop = asyncio.Event()
        zero = Cost(0.0, 0.0, 0.0, 8192)
        workers = [
            Worker([SimDevice(f"cal{i}", model_ids, zero)], settings(url, heartbeat_s=0.5), worker_id=f"cal-{i}")
            for i in range(num_workers)
        ]
        tasks = [asyncio.create_task(w.run(stop)) for w in workers]
        while not os.path.exists(stop_file):
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


async def measure_shoal(
    url: str, host_pid: int, nats_pid: int, workload: Workload, num_workers: int, n: int, concurrency: int
) -> dict[str, float]:
    """The gateway's and the workers' CPU per call, and nats-server's, on zero-cost devices."""
    from shoal.cluster.gateway import RemoteService

    gateway = RemoteService(Settings(cluster=settings(url, heartbeat_s=0.5)), Catalog.load())
    await gateway.start()
    for _ in range(600):
        if gateway.ready and len(gateway.workers.live()) >= num_workers:
            break
        await asyncio.sleep(0.1)
    else:
        raise SystemExit("the calibration's workers did not show up")

    async def drive(count: int) -> None:
        left = iter(range(count))

        async def client() -> None:
            for _ in left:
                await gateway.run(workload.next())

        await asyncio.gather(*(client() for _ in range(concurrency)))

    await drive(200)  # warm
    cpu0, host0, nats0, wall0 = time.process_time(), proc_cpu_s(host_pid), proc_cpu_s(nats_pid), time.perf_counter()
    await drive(n)
    wall = time.perf_counter() - wall0
    out = {
        "gateway_call_s": (time.process_time() - cpu0) / n,
        "worker_call_s": (proc_cpu_s(host_pid) - host0) / n,
        "nats_call_s": (proc_cpu_s(nats_pid) - nats0) / n,
        "calls_per_s": n / wall,
    }
    # A heartbeat, as the gateway's directory reads it (decoded, recorded).
    beat = msgspec_beat(workload)
    msg = SimpleNamespace(data=beat, subject="shoal.hb.x")
    cpu0 = time.process_time()
    for _ in range(20_000):
        await gateway.workers.on_heartbeat(msg)
    out["heartbeat_decode_s"] = (time.process_time() - cpu0) / 20_000
    await gateway.stop()
    return out


def msgspec_beat(workload: Workload) -> bytes:
    import msgspec

    device = SimDevice("hb", sorted(set(c.model for c in workload.calls)), Cost(0.0, 0.0, 0.0, 8192))
    beat = p.Heartbeat(
        worker="w-hb", pool=POOL, host="h", devices=("hb",), models=device.models(), free_tokens=900, sent_at=p.now()
    )
    return msgspec.msgpack.encode(beat)


async def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    model_ids = [f"sim/model-{i}" for i in range(args.models)]
    workload = Workload(model_ids, 1.1, 30.0)
    call = workload.calls[0]
    body = calls.encode(call)
    headers = {p.REQUEST_ID: "r", p.DEADLINE: f"{p.now() + 30:.6f}", p.TOKENS: "200", p.REPLY: "_INBOX.shoal.x.y"}
    store = Path(tempfile.mkdtemp(prefix="shoal-calibrate-"))
    port = free_port()
    nats = start_nats(port, store)
    url = f"nats://127.0.0.1:{port}"
    stop_file = str(store / "stop")
    try:
        server = await measure_server(url, nats.pid, args.ops, body, headers, args.concurrency)
        client = await measure_client(url, args.ops, body, headers)
        host = multiprocessing.get_context("spawn").Process(
            target=host_main, args=(url, args.workers, model_ids, stop_file), daemon=True
        )
        host.start()
        shoal = await measure_shoal(url, host.pid, nats.pid, workload, args.workers, args.calls, args.concurrency)
        Path(stop_file).touch()
        host.join(30)
    finally:
        nats.terminate()
        nats.wait(10)
        shutil.rmtree(store, ignore_errors=True)
    share = client["publish_s"] / max(1e-12, client["publish_s"] + client["receive_s"])
    return {
        "source": f"calibrate, {time.strftime('%Y-%m-%d')}, {machine_line(os.getloadavg(), 'nats-server, gateway and one worker host').split(':', 1)[1].strip()}",
        "bus": {k: server[k] for k in ("publish_s", "deliver_s", "ack_s", "fetch_s", "core_s", "latency_s", "api_s")}
        | {"status_s": max(0.0, server["empty_fetch_s"] - server["fetch_s"])},
        "gateway": {
            "publish_s": shoal["gateway_call_s"] * share,
            "receive_s": shoal["gateway_call_s"] * (1 - share),
            "heartbeat_s": shoal["heartbeat_decode_s"] + client["receive_s"],
        },
        "worker": {"pulled_s": shoal["worker_call_s"]},
        "measured": {"server": server, "client": client, "shoal": shoal},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measure the simulation's costs on a real nats-server and shoal")
    ap.add_argument("--ops", type=int, default=20_000, help="operations per nats-server measurement")
    ap.add_argument("--calls", type=int, default=4_000, help="calls through the real gateway and workers")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--out", type=Path, default=cluster_sim.COSTS_FILE)
    args = ap.parse_args(argv)
    costs = asyncio.run(calibrate(args))
    args.out.write_text(json.dumps(costs, indent=1) + "\n")
    print(json.dumps(costs, indent=1))
    return 0
