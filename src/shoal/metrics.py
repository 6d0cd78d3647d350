"""Prometheus metrics: every metric shoal declares, for the server, the gateway and the worker.

    Metrics()                the engine and the HTTP API (`shoal serve`; a worker's engines; the
                             gateway's HTTP routes); owns its registry, which the others join
    GatewayMetrics(registry) the cluster gateway: calls published and answered, demand, the queue
    WorkerMetrics(registry)  a cluster worker: calls pulled, handed back, held, finished

One `Metrics` object per process, built by a factory and passed down; the role's class is built on
its registry by the gateway or the worker. Nothing registers at import (no global registry), so
tests can build many. Names are the ones docs/operations.md lists and the dashboards and alert
rules query: never rename one.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "shoal_requests", "HTTP requests by route, model and status", ["route", "model", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "shoal_request_duration_seconds",
            "HTTP request latency",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "shoal_tokens", "Tokens run through a model (real tokens, no padding)", ["model"], registry=r
        )
        self.items = Counter("shoal_items", "Items (texts) run through a model", ["model"], registry=r)
        self.generated_tokens = Counter(
            "shoal_generated_tokens", "New tokens a generating model wrote", ["model"], registry=r
        )
        self.first_token_seconds = Histogram(
            "shoal_time_to_first_token_seconds",
            "From a generation call's start to its first new token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "shoal_batch_tokens", "Real tokens per batch", ["model"], buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_items = Histogram(
            "shoal_batch_items", "Items per batch", ["model"], buckets=_ITEM_BUCKETS, registry=r
        )
        self.phase_seconds = Histogram(
            "shoal_phase_duration_seconds",
            "Time per request phase (tokenize, queue, inference)",
            ["phase", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("shoal_queue_depth", "Items admitted and not yet answered", registry=r)
        self.queue_tokens = Gauge("shoal_queue_tokens", "Estimated tokens admitted and not yet answered", registry=r)
        self.rejected = Counter("shoal_rejected", "Requests refused because the queue was full", ["model"], registry=r)
        self.dropped_items = Counter(
            "shoal_dropped_items",
            "Items dropped before compute: their caller went away or their deadline passed",
            ["model", "reason"],
            registry=r,
        )
        self.deadline_exceeded = Counter(
            "shoal_deadline_exceeded",
            "Calls that missed their deadline, by the phase they waited in",
            ["model", "phase"],
            registry=r,
        )
        self.failed_items = Counter("shoal_failed_items", "Items whose forward pass failed", ["model"], registry=r)
        self.device_restarts = Counter("shoal_device_restarts", "Times a dead device thread was restarted", registry=r)
        self.loaded_models = Gauge("shoal_loaded_models", "Models loaded on this process", registry=r)
        self.loaded_bytes = Gauge(
            "shoal_loaded_model_bytes",
            "Bytes held by resident models (measured tensors, adapters, and the largest one's batch workspace)",
            registry=r,
        )
        # Residency (engine/cache.py).
        self.memory_budget_bytes = Gauge(
            "shoal_memory_budget_bytes", "The device's memory budget", ["device"], registry=r
        )
        self.device_bytes = Gauge("shoal_device_resident_bytes", "Bytes resident on the device", ["device"], registry=r)
        self.model_bytes = Gauge(
            "shoal_model_resident_bytes", "Bytes one resident model holds (with its adapters)", ["model"], registry=r
        )
        self.loads = Counter(
            "shoal_model_loads", "Model loads by outcome (ok, failed, no_room)", ["model", "outcome"], registry=r
        )
        self.load_seconds = Histogram(
            "shoal_model_load_seconds",
            "Seconds a successful model load took (fetch and materialize)",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "shoal_model_evictions",
            "Models unloaded, by reason (evicted, unload, changed)",
            ["model", "reason"],
            registry=r,
        )
        self.cold_start_wait_seconds = Histogram(
            "shoal_cold_start_wait_seconds",
            "Seconds a request waited for its model to load",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.adapters_resident = Gauge("shoal_adapters_resident", "LoRA adapters resident on the device", registry=r)

    def start_models(self, model_ids: Iterable[str]) -> None:
        """Give every per-model counter of `model_ids` a series at 0 from the first scrape: a series
        born at 1 shows no `increase()` (an alert on the first failed load would never fire), and a
        dashboard shows 0 rather than nothing."""
        for model in model_ids:
            for outcome in ("ok", "failed", "no_room"):
                self.loads.labels(model, outcome)
            for reason in ("evicted", "unload", "changed"):
                self.evictions.labels(model, reason)
            for reason in ("cancelled", "deadline"):
                self.dropped_items.labels(model, reason)
            self.failed_items.labels(model)
            self.rejected.labels(model)
            self.generated_tokens.labels(model)
            self.tokens.labels(model)
            self.items.labels(model)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class GatewayMetrics:
    """The cluster gateway's metrics, on the registry of its `Metrics` (which has its HTTP routes')."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.inflight = Gauge(
            "shoal_gateway_inflight_calls", "Calls published and not yet answered", ["model"], registry=r
        )
        self.published = Counter(
            "shoal_gateway_published_calls", "Calls published to the work queue", ["model", "pool"], registry=r
        )
        self.demand = Gauge(
            "shoal_gateway_demand",
            "Requests in the last minute for a model no live worker serves (what scales a pool up from zero)",
            ["model"],
            registry=r,
        )
        self.unserved = Counter(
            "shoal_gateway_unserved_requests",
            "Requests refused because no live worker serves the model",
            ["model"],
            registry=r,
        )
        self.dead_letters = Counter(
            "shoal_dead_letters", "Calls delivered max_deliver times without an answer", ["model"], registry=r
        )
        self.objects = Counter(
            "shoal_gateway_object_payloads",
            "Calls (sent) and results (received) that went through the Object Store",
            ["direction"],
            registry=r,
        )
        self.workers = Gauge("shoal_gateway_workers", "Live workers, by pool", ["pool"], registry=r)
        self.connected = Gauge("shoal_gateway_nats_connected", "1 while the gateway is connected to NATS", registry=r)
        # The queue, as JetStream sees it (cluster/queue_gauges.py): what KEDA's nats-jetstream
        # trigger scales on, here for dashboards and the lag alert.
        self.queue_pending = Gauge(
            "shoal_queue_pending_calls",
            "Calls in the work queue not yet delivered to a worker",
            ["pool", "model"],
            registry=r,
        )
        self.queue_unacked = Gauge(
            "shoal_queue_unacked_calls",
            "Calls delivered to a worker and not yet acked (running, or held on its host)",
            ["pool", "model"],
            registry=r,
        )
        self.abandoned = Counter(
            "shoal_gateway_abandoned_calls",
            "Calls given up before their reply (deadline "
            "or client gone): deleted from the queue or cancelled on their worker",
            ["model", "reason"],
            registry=r,
        )
        for direction in ("call", "result"):  # at 0 from the first scrape: rate() sees the first one
            self.objects.labels(direction)

    def start_models(self, model_ids: Iterable[str]) -> None:
        """Series at 0 for the catalog's models (see `Metrics.start_models`): the dead-letter alert
        sees the first one, and a pool's wake-up query (`shoal_gateway_demand`) reads 0, not nothing."""
        for model in model_ids:
            self.dead_letters.labels(model)
            self.unserved.labels(model)
            self.inflight.labels(model).set(0)
            self.demand.labels(model).set(0)
            for reason in ("deadline", "cancelled"):
                self.abandoned.labels(model, reason)


class WorkerMetrics:
    """A cluster worker's metrics, on the registry of its `Metrics` (which its engines share)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.calls = Counter(
            "shoal_worker_calls",
            "Calls a worker finished, by outcome: ok, error, dropped_deadline "
            "(never run: its deadline had passed), dropped_cancelled (its caller went away)",
            ["model", "outcome"],
            registry=r,
        )
        self.pulled = Counter("shoal_worker_pulled_calls", "Calls pulled from the work queue", ["model"], registry=r)
        self.naks = Counter(
            "shoal_worker_naks",
            "Calls handed back to the queue: over-pulled (no room when they "
            "arrived) or drained (the worker was stopping)",
            ["model", "reason"],
            registry=r,
        )
        self.redelivered = Counter(
            "shoal_worker_redelivered_calls",
            "Calls received again after an earlier delivery went unacked (a worker died, or ran past ack_wait)",
            ["model"],
            registry=r,
        )
        self.held_tokens = Gauge(
            "shoal_worker_held_tokens",
            "Estimated tokens of the calls the worker holds (queued on the host or running)",
            registry=r,
        )
        self.host_queue = Gauge("shoal_worker_host_queue_calls", "Calls pulled and waiting for a device", registry=r)
        self.cold_looks = Counter(
            "shoal_worker_cold_looks",
            "Looks at the queue of a model no device of the worker has loaded, by source: backlog (the "
            "gateways' feed) or jetstream (an API request: no gateway publishes the backlog)",
            ["model", "source"],
            registry=r,
        )

    def start_models(self, model_ids: Iterable[str]) -> None:
        """Series at 0 for the models the worker serves (see `Metrics.start_models`)."""
        for model in model_ids:
            for outcome in ("ok", "error", "dropped_deadline", "dropped_cancelled"):
                self.calls.labels(model, outcome)
            for reason in ("over_pulled", "drained"):
                self.naks.labels(model, reason)
            self.pulled.labels(model)
            self.redelivered.labels(model)
