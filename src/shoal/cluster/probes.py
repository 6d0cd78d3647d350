"""A worker's heartbeats and probes.

Heartbeats.run ─ every heartbeat_s ─▶ shoal.hb.<worker> (core NATS): pool, devices, models and
                 their status, free and held tokens, tokens/s, draining; also at once when a
                 gateway pings (shoal.ping), when the worker starts draining and when it stops
health()       ─ live unless the heartbeat loop stopped turning (a wedged event loop); ready
                 while it pulls (started, connected, not draining)
serve_probes   ─ /metrics, /healthz, /readyz on their own thread: a wedged loop still answers
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import ClusterSettings
from . import protocol as p
from .host_queue import HostQueue

if TYPE_CHECKING:
    import http.server

    from .worker import Worker

log = logging.getLogger("shoal.worker")


class Heartbeats:
    """What the worker says about itself, and when it last said it (its liveness)."""

    def __init__(self, worker_id: str, hostname: str, settings: ClusterSettings, queue: HostQueue) -> None:
        self.worker_id = worker_id
        self.hostname = hostname
        self.settings = settings
        self.queue = queue
        self.last_beat = 0.0  # time.monotonic() of the loop's last turn

    def beat(self) -> p.Heartbeat:
        devices = self.queue.devices
        first = devices[0].service
        statuses = first.models()
        if len(devices) > 1:  # loaded on any device: loaded on the host
            loaded = {s.id for d in devices[1:] for s in d.service.models() if s.loaded}
            statuses = [
                msgspec.structs.replace(s, loaded=True, state="loaded") if s.id in loaded and not s.loaded else s
                for s in statuses
            ]
        rates = [d.service.capacity().tokens_per_s for d in devices]
        return p.Heartbeat(
            worker=self.worker_id,
            pool=self.settings.pool,
            host=self.hostname,
            devices=tuple(d.name for d in devices),
            models=statuses,
            problems=first.problems(),
            free_tokens=max(0, self.queue.room()),
            inflight_tokens=self.queue.held(),
            tokens_per_s=sum(r for r in rates if r) or None,
            draining=self.queue.draining,
            sent_at=p.now(),
        )

    async def send(self, nc: Any) -> None:
        """One heartbeat now; never raises (a status that fails to build: the next beat may not)."""
        try:
            data = msgspec.msgpack.encode(self.beat())
        except Exception:  # broad: a service's status may fail in any way; the worker must keep beating
            log.exception("worker %s: heartbeat", self.worker_id)
            return
        try:
            await nc.publish(f"{p.HEARTBEAT_PREFIX}.{p.token(self.worker_id)}", data)
        except Exception as exc:  # broad: never raises; cut off, gateways count the worker out after worker_ttl_s
            p.log_swallowed(log, exc, "worker %s: heartbeat not sent", self.worker_id)

    async def run(self, nc: Any) -> None:
        while True:
            self.last_beat = time.monotonic()
            await self.send(nc)
            await asyncio.sleep(self.settings.heartbeat_s)


def health(worker: Worker) -> tuple[bool, bool, str]:
    """(live, ready, why): live unless the heartbeat loop has stopped turning (a wedged event
    loop); ready while it pulls: started, connected, not draining."""
    if not worker.started.is_set():
        return True, False, "starting (loading preloads, or waiting for NATS)"
    silent = time.monotonic() - worker.beats.last_beat
    if silent > max(5.0, 5 * worker.settings.heartbeat_s):
        return False, False, f"the heartbeat loop has not run for {silent:.0f} s"
    if worker.draining:
        return True, False, "draining"
    if not worker.connected:
        return True, False, "not connected to NATS"
    return True, True, "pulling"


def serve_probes(worker: Worker, host: str, port: int) -> http.server.ThreadingHTTPServer:
    """A small HTTP server on its own thread: `/metrics` (Prometheus), `/healthz` (200 while the
    worker is live, else 503) and `/readyz` (200 while it pulls). Returns the server (`.shutdown()`)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name for it
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                status, body, kind = 200, worker.metrics.exposition(), worker.metrics.content_type
            elif path in ("/healthz", "/readyz"):
                live, ready, why = worker.health()
                ok = live if path == "/healthz" else ready
                status, body, kind = (200 if ok else 503), (why + "\n").encode(), "text/plain; charset=utf-8"
            else:
                status, body, kind = 404, b"not found: /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-probes", daemon=True).start()
    return server
