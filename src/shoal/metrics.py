"""Prometheus metrics: one `Metrics` object per process, built by a factory and passed down.

Every metric lives in the object's own registry (no global state, so tests can build many).
Names are the ones docs/operations.md lists and dashboards may query.
"""

from __future__ import annotations

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
        self.requests = Counter("shoal_requests", "HTTP requests by route, model and status", ["route", "model", "status"], registry=r)
        self.request_seconds = Histogram(
            "shoal_request_duration_seconds", "HTTP request latency", ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("shoal_tokens", "Tokens run through a model (real tokens, no padding)", ["model"], registry=r)
        self.items = Counter("shoal_items", "Items (texts) run through a model", ["model"], registry=r)
        self.batch_tokens = Histogram("shoal_batch_tokens", "Real tokens per batch", ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_items = Histogram("shoal_batch_items", "Items per batch", ["model"], buckets=_ITEM_BUCKETS, registry=r)
        self.phase_seconds = Histogram(
            "shoal_phase_duration_seconds", "Time per request phase (tokenize, queue, inference)", ["phase", "model"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("shoal_queue_depth", "Items admitted and not yet answered", registry=r)
        self.queue_tokens = Gauge("shoal_queue_tokens", "Estimated tokens admitted and not yet answered", registry=r)
        self.rejected = Counter("shoal_rejected", "Requests refused because the queue was full", ["model"], registry=r)
        self.dropped_items = Counter(
            "shoal_dropped_items", "Items dropped before compute: their caller went away or their deadline passed",
            ["model", "reason"], registry=r,
        )
        self.deadline_exceeded = Counter(
            "shoal_deadline_exceeded", "Calls that missed their deadline, by the phase they waited in", ["model", "phase"],
            registry=r,
        )
        self.failed_items = Counter("shoal_failed_items", "Items whose forward pass failed", ["model"], registry=r)
        self.device_restarts = Counter("shoal_device_restarts", "Times a dead device thread was restarted", registry=r)
        self.loaded_models = Gauge("shoal_loaded_models", "Models loaded on this process", registry=r)
        self.loaded_bytes = Gauge("shoal_loaded_model_bytes", "Bytes held by resident models (measured tensors, "
                                  "adapters, and the largest one's batch workspace)", registry=r)
        # Residency (engine/cache.py).
        self.memory_budget_bytes = Gauge("shoal_memory_budget_bytes", "The device's memory budget", ["device"], registry=r)
        self.device_bytes = Gauge("shoal_device_resident_bytes", "Bytes resident on the device", ["device"], registry=r)
        self.model_bytes = Gauge("shoal_model_resident_bytes", "Bytes one resident model holds (with its adapters)",
                                 ["model"], registry=r)
        self.loads = Counter("shoal_model_loads", "Model loads by outcome (ok, failed, no_room)", ["model", "outcome"],
                             registry=r)
        self.load_seconds = Histogram("shoal_model_load_seconds", "Seconds a successful model load took (fetch and "
                                      "materialize)", ["model"], buckets=_LOAD_BUCKETS, registry=r)
        self.evictions = Counter("shoal_model_evictions", "Models unloaded, by reason (evicted, unload, changed)",
                                 ["model", "reason"], registry=r)
        self.cold_start_wait_seconds = Histogram(
            "shoal_cold_start_wait_seconds", "Seconds a request waited for its model to load", ["model"],
            buckets=_LOAD_BUCKETS, registry=r)
        self.adapters_resident = Gauge("shoal_adapters_resident", "LoRA adapters resident on the device", registry=r)

    def start_models(self, model_ids) -> None:
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
            self.tokens.labels(model)
            self.items.labels(model)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
